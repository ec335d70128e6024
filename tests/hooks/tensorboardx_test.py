"""tensorboardX is imported without PyTorch, even when torch is installed.

A stand-in ``torch`` package on the path records whether anything imported it; a fresh
process imports the library's summary writers and event reader, writes and reads a scalar.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

_FAKE_TORCH = """
Tensor = type("Tensor", (), {})
import os
open(os.environ["TORCH_MARKER"], "w").write("imported")
"""

_PROGRAM = textwrap.dedent(
    """
    import os, sys
    import hooks
    from estimator import summary
    import numpy as np
    from tensorboardX import SummaryWriter
    w = SummaryWriter(sys.argv[1])
    w.add_scalar("x", np.float32(1.5), 3)
    w.close()
    print("torch" in sys.modules, os.path.exists(os.environ["TORCH_MARKER"]))
    import torch  # the user's own import still works afterwards
    print(os.path.exists(os.environ["TORCH_MARKER"]))
    """
)


def test_tensorboardx_does_not_import_torch(tmp_path):
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text(_FAKE_TORCH)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), root]),
        TORCH_MARKER=str(tmp_path / "marker"),
    )
    out = subprocess.run(
        [sys.executable, "-c", _PROGRAM, str(tmp_path / "events")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.split("\n")[:2]
    assert first == "False False"  # nothing imported torch while the library loaded
    assert second == "True"


def test_stand_in_torch_is_seen_by_plain_tensorboardx(tmp_path):
    """The reproduction: without the library, importing tensorboardX imports torch."""
    (tmp_path / "site" / "torch").mkdir(parents=True)
    (tmp_path / "site" / "torch" / "__init__.py").write_text(_FAKE_TORCH)
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), TORCH_MARKER=str(tmp_path / "m"))
    out = subprocess.run(
        [sys.executable, "-c", "import tensorboardX"], env=env, capture_output=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "m").exists()
