"""Suite-wide settings."""

import importlib.util
import os
import sys
from pathlib import Path

# Subprocesses the tests start with `python -m`/`-c` from the repo root must not find the repo's operator/
# folder before the standard library's `operator` (Python 3.11+ honours this).
os.environ["PYTHONSAFEPATH"] = "1"

# pytest puts the repo root on sys.path (tests/ is a package), where the kernels/ folder (installed as
# headroom.kernels) would stand in for PyPI's `kernels`, which transformers 5.2x imports for its hub kernels
# (`from kernels import CUDAProperties`: an ImportError in every test that builds a transformers model). Import
# the installed one first, with the root out of the path, so that sys.modules holds it.
_root = Path(__file__).resolve().parents[1]
_saved = sys.path[:]
sys.path[:] = [p for p in sys.path if Path(p or os.curdir).resolve() != _root]
try:
    if importlib.util.find_spec("kernels") is not None:
        import kernels  # noqa: F401
finally:
    sys.path[:] = _saved
