"""Suite-wide settings."""

import os

# Subprocesses the tests start with `python -m`/`-c` from the repo root must not find the repo's operator/
# folder before the standard library's `operator` (Python 3.11+ honours this).
os.environ["PYTHONSAFEPATH"] = "1"
