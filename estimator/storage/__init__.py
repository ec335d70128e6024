"""The storage seam: every path under model_dir and the export directories, local or a URL.

``files`` holds the path and file functions (local paths through ``os``, ``gs://`` and other
fsspec URLs through ``etils.epath``); ``events`` makes tensorboardX write event files there.
They sit below every other layer: the vocabulary (``summary``) and ``io`` both use them.

Example:
  >>> from estimator import storage
  >>> storage.join(storage.absolute("gs://bucket/run/"), "model.ckpt-100")
  'gs://bucket/run/model.ckpt-100'
"""

from .files import (
    COMMIT_FILE,
    absolute,
    basename,
    check_backend,
    dirname,
    download_tree,
    epath_of,
    exists,
    finished_step,
    glob,
    is_url,
    isdir,
    isfile,
    join,
    listdir,
    local_copy,
    makedirs,
    open_file,
    read_bytes,
    read_text,
    rename,
    rmtree,
    scheme,
    staged,
    stamp,
    upload_tree,
    write_bytes,
)

__all__ = [
    "COMMIT_FILE",
    "scheme",
    "is_url",
    "absolute",
    "join",
    "dirname",
    "basename",
    "check_backend",
    "epath_of",
    "exists",
    "isdir",
    "isfile",
    "listdir",
    "makedirs",
    "rmtree",
    "rename",
    "read_bytes",
    "read_text",
    "write_bytes",
    "open_file",
    "glob",
    "stamp",
    "finished_step",
    "staged",
    "upload_tree",
    "local_copy",
    "download_tree",
]
