"""Reassemble a file that travelled as `split -b` parts (part-aa, part-ab, ...) and check its sha256.

The SmolLM2 GGUF (98 MB) is larger than one transfer to the GPU machine (64 MiB),
so benchmarks/e2e_smollm2.py receives it in parts over two calls.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from runtime.errors import InputError


def split_suffixes(n: int) -> list[str]:
    """`split -a 2` part suffixes in order: aa, ab, ..., az, ba, ..."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [letters[i // 26] + letters[i % 26] for i in range(n)]


def assemble_parts(parts_dir: Path, dest_dir: Path) -> Path:
    """Join parts_dir/part-* (name order) into dest_dir and check the sha256 in parts_dir/SHA256."""
    if not parts_dir.is_dir():
        raise InputError(f"--gguf-parts {parts_dir} is not a directory; copy every part-* and SHA256 into one directory.")
    sha_file = parts_dir / "SHA256"
    if not sha_file.is_file():
        raise InputError(f"{sha_file} is missing; it holds the sha256 of the whole GGUF (`sha256sum FILE > SHA256`).")
    fields = sha_file.read_text().split()
    if not fields or len(fields[0]) != 64:
        raise InputError(f"{sha_file} does not start with a 64-hex-digit sha256; rewrite it with `sha256sum FILE > SHA256`.")
    expected, name = fields[0].lower(), (fields[1] if len(fields) > 1 else "model.gguf").lstrip("*")
    parts = sorted(parts_dir.glob("part-*"))
    names = [p.name.removeprefix("part-") for p in parts]
    if not parts or names != split_suffixes(len(parts)):
        missing = sorted(set(split_suffixes(len(parts) + 1)[:-1]) - set(names)) or ["aa"]
        raise InputError(f"{parts_dir}: parts {', '.join('part-' + m for m in missing)} missing (found: "
             f"{', '.join(p.name for p in parts) or 'none'}); copy every part of the split file there.")
    out = dest_dir / name
    h = hashlib.sha256()
    with open(out, "wb") as f:
        for p in parts:
            with open(p, "rb") as src:
                while chunk := src.read(16 << 20):
                    h.update(chunk)
                    f.write(chunk)
    if h.hexdigest() != expected:
        out.unlink()
        sizes = ", ".join(f"{p.name} {p.stat().st_size} B" for p in parts)
        raise InputError(f"{parts_dir}: the joined parts ({sizes}) have sha256 {h.hexdigest()}, SHA256 says {expected}; "
             "a part is missing, truncated or from another file: copy the parts again.")
    print(f"reassembled {out.name} from {len(parts)} parts, sha256 ok", flush=True)
    return out
