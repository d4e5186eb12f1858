"""Pack the parts of the nvidia-pytriton wheel that `kvq serve` uses into one small tar.xz.

The wheel (55 MB) is most of what one transfer to the GPU machine may carry. kvq needs only
tritonserver, its bundled libraries, the python backend and the stub for one Python version;
the wheel also ships a private libpython 3.13 (no binary links it) and stubs for five other
Python versions. What stays unpacks into a directory that works as a PYTHONPATH entry
(`importlib.util.find_spec("pytriton")` finds it):

    python -m benchmarks.pack_pytriton nvidia_pytriton-0.7.0-*.whl --python 3.12 --out .whl/pytriton-slim.tar.xz
    # on the GPU machine:  mkdir -p /tmp/site && tar -xJf .whl/pytriton-slim.tar.xz -C /tmp/site
"""

from __future__ import annotations

import argparse
import io
import re
import tarfile
import zipfile
from pathlib import Path

STUBS = "pytriton/tritonserver/python_backend_stubs/"
KEEP = ("pytriton/__init__.py", "pytriton/tritonserver/", "nvidia_pytriton.libs/")


def keep(name: str, python: str) -> bool:
    if not name.startswith(KEEP):
        return False
    if name.startswith(STUBS):
        return name.startswith(f"{STUBS}{python}/")
    return not re.match(r"nvidia_pytriton\.libs/libpython3-[0-9a-f]+\.\d+\.so", name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", type=Path)
    ap.add_argument("--python", default="3.12", help="the GPU machine's Python (its stub is kept)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(args.out.name + ".tmp")
    with zipfile.ZipFile(args.wheel) as whl, tarfile.open(tmp, "w:xz", preset=9) as tar:
        for info in whl.infolist():
            if info.is_dir() or not keep(info.filename, args.python):
                continue
            data = whl.read(info)
            member = tarfile.TarInfo(info.filename)
            member.size = len(data)
            # the wheel keeps the unix mode in the high 16 bits: executables must stay executable
            member.mode = (info.external_attr >> 16) & 0o777 or 0o644
            tar.addfile(member, io.BytesIO(data))
    tmp.replace(args.out)
    print(f"{args.out}: {args.out.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
