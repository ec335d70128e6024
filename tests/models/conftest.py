from tests.configs._jobs import fast_compile, zoo  # noqa: F401
