"""Streaming safetensors writer: one tensor in memory at a time.

`safetensors.torch.save_file` needs every tensor at once, which for a 70B model
means a second copy of the model in memory. The format is simple enough to
stream (https://github.com/huggingface/safetensors#format):

    8 bytes   little-endian u64 N = header length
    N bytes   JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}
              (padded with spaces to a multiple of 8 so the data is aligned)
    ...       the raw little-endian bytes of every tensor, back to back

Offsets follow from shapes and dtypes alone, so the header is written first
and each tensor's bytes are appended as it is produced. The writer checks that
every tensor arrives in the announced order with the announced shape/dtype,
and `close()` fails if any is missing: a file it finishes is always complete.
Readers (safetensors.safe_open) validate the same invariants.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import InputError

# safetensors dtype codes for the tensors kvq writes.
_ST_DTYPE = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.int32: "I32",
    torch.int64: "I64",
}

CHUNK_BYTES = 64 << 20

# User-facing weight dtypes (recipes, CLI) -> torch dtype and the HF config name.
WEIGHT_DTYPES = {
    "fp32": (torch.float32, "float32"),
    "fp16": (torch.float16, "float16"),
    "bf16": (torch.bfloat16, "bfloat16"),
}
_ALIASES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16", "float": "fp32"}


def weight_dtype(name: str) -> tuple[str, torch.dtype, str]:
    """Normalise a weight dtype name: returns (short name, torch dtype, HF/TRT-LLM name)."""
    short = _ALIASES.get(name, name)
    if short not in WEIGHT_DTYPES:
        raise InputError(
            f"unknown weight dtype {name!r}; choose one of {', '.join(WEIGHT_DTYPES)}."
        )
    t, hf = WEIGHT_DTYPES[short]
    return short, t, hf


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


def _header_bytes(specs: list[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for s in specs:
        if s.dtype not in _ST_DTYPE:
            raise ValueError(f"dtype {s.dtype} of {s.name} has no safetensors code")
        header[s.name] = {"dtype": _ST_DTYPE[s.dtype], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


class StreamingSafetensorsWriter:
    """Write `specs` to `path` one tensor at a time, in the order given.

    A floating-point tensor is cast to its spec's dtype on the way out.

    Use as a context manager; leaving the block with an exception deletes the
    partial file, leaving it normally requires that every tensor was written.
    """

    def __init__(self, path: str | Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError("duplicate tensor names in safetensors specs")
        self.path = Path(path)
        self.specs = list(specs)
        self._next = 0
        self._header = _header_bytes(self.specs, metadata)
        self._f = None

    def __enter__(self) -> StreamingSafetensorsWriter:
        self._f = open(self.path, "wb")
        self._f.write(struct.pack("<Q", len(self._header)))
        self._f.write(self._header)
        return self

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self.specs):
            raise ValueError(f"{self.path}: unexpected extra tensor {name}")
        spec = self.specs[self._next]
        if name != spec.name:
            raise ValueError(f"{self.path}: expected tensor {spec.name} next, got {name}")
        castable = tensor.dtype.is_floating_point and spec.dtype.is_floating_point
        if tuple(tensor.shape) != spec.shape or (tensor.dtype != spec.dtype and not castable):
            raise ValueError(
                f"{self.path}: tensor {name} is {tuple(tensor.shape)} {tensor.dtype}, "
                f"announced {spec.shape} {spec.dtype}"
            )
        # Cast and write in slices so a multi-GB tensor never exists twice
        # (source dtype + target dtype) in memory.
        flat = tensor.detach().reshape(-1)
        step = max(1, CHUNK_BYTES // flat.element_size())
        for chunk in flat.split(step):
            c = chunk.to(device="cpu", dtype=spec.dtype).contiguous()
            # A uint8 view exposes the raw bytes (x86/ARM are little-endian like
            # the format) without a copy; numpy hands the file a buffer.
            self._f.write(c.view(torch.uint8).numpy().data)
        self._next += 1

    def __exit__(self, exc_type, exc, tb) -> None:
        self._f.close()
        if exc_type is not None:
            self.path.unlink(missing_ok=True)
            return
        if self._next != len(self.specs):
            self.path.unlink(missing_ok=True)
            missing = ", ".join(s.name for s in self.specs[self._next:self._next + 3])
            raise ValueError(f"{self.path}: closed before tensors were written: {missing} ...")


def write_streaming(path: str | Path, specs: list[TensorSpec], produce, metadata: dict[str, str] | None = None) -> int:
    """Write every spec, calling `produce(spec) -> tensor` for each in turn; returns bytes of data."""
    with StreamingSafetensorsWriter(path, specs, metadata) as w:
        for s in specs:
            w.write(s.name, produce(s))
    return sum(s.nbytes for s in specs)
