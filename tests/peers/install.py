"""Install the pinned SGLang and vLLM releases for the peer tests, without their heavy dependencies.

Usage: install.py <pip> <target dir>. Downloads every wheel of requirements.txt (--no-deps) into
<target>/wheels, unpacks the Python files of sglang and vllm (their compiled modules are left out: the
tests stub vLLM's CUDA extension) and installs the small helper modules with --no-deps into <target>/site.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ENGINES = ("sglang", "vllm")


def main(pip: str, target: str) -> None:
    root = Path(target)
    wheels, site = root / "wheels", root / "site"
    requirements = Path(__file__).with_name("requirements.txt")
    wheels.mkdir(parents=True, exist_ok=True)
    subprocess.run([pip, "download", "-q", "--no-deps", "-d", str(wheels), "-r", str(requirements)], check=True)
    shutil.rmtree(site, ignore_errors=True)
    site.mkdir(parents=True)
    helpers = []
    for wheel in sorted(wheels.glob("*.whl")):
        name = wheel.name.split("-")[0].lower()
        if name in ENGINES:
            with zipfile.ZipFile(wheel) as archive:
                # Compiled modules only load on a GPU host; the Python files are what the tests read.
                members = [m for m in archive.namelist() if ".so" not in m.rsplit("/", 1)[-1]]
                archive.extractall(site, members=members)
        else:
            helpers.append(str(wheel))
    subprocess.run([pip, "install", "-q", "--no-deps", "--no-compile", "--target", str(site), *helpers], check=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
