"""The per-device tuned file (tuned/<device>.json): each KV format's kernel choices and the prefill tile, and the
`Device` whose name keys it.

The file is data a tuning run writes (benchmarks/tune.py) and a person may edit, so it is checked field by field
when it loads: a misspelt or missing field fails there instead of leaving a default in force. The H200's file
serves every device without one of its own, and the interpreter. `plan.py` reads a format's entry through
`format_tuned` and turns it into launch plans.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import asdict, dataclass, fields, is_dataclass
from importlib import resources
from typing import Literal

import torch

from ..kv_format import KVFormat, format_from_name
from .formats import served_by_mixed


@dataclass(frozen=True)
class Device:
    """What a plan needs to know about the GPU: its tuned file's name, SMs, major compute capability; `cuda`: the
    tensors are CUDA tensors; `interpret`: the Triton interpreter runs the kernels (no Gluon, no PTX)."""

    name: str
    sms: int
    capability: int
    cuda: bool = True
    interpret: bool = False


DEVICE_H200 = Device("NVIDIA H200", 132, 9)


def device_of(device: torch.device | str) -> Device:
    from triton import knobs

    device = torch.device(device)
    interpret = bool(knobs.runtime.interpret)
    if device.type != "cuda":
        return Device("interpreter", 4, 0, cuda=False, interpret=interpret)  # any small SM count exercises the rules
    props = torch.cuda.get_device_properties(device)
    return Device(props.name, props.multi_processor_count, torch.cuda.get_device_capability(device)[0],
                  interpret=interpret)


def _checked(tp, value, where: str):
    """`value` read from JSON as type `tp`: dataclasses field by field (no unknown or missing field), dicts, Literal
    choices, bool / int / str exactly (a bool is no int here).
    why by hand: runtime stays free of pydantic (it runs with torch, triton, numpy only)."""
    if is_dataclass(tp):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {value!r}")
        hints = typing.get_type_hints(tp)
        names = [f.name for f in fields(tp)]
        unknown, missing = sorted(set(value) - set(names)), [n for n in names if n not in value]
        if unknown or missing:
            raise ValueError(f"{where}: unknown fields {unknown}, missing fields {missing} (fields: {', '.join(names)})")
        return tp(**{n: _checked(hints[n], value[n], f"{where}.{n}") for n in names})
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {value!r}")
        return {_checked(args[0], k, f"{where} key"): _checked(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is Literal:
        if value not in args or isinstance(value, bool) != isinstance(args[0], bool):
            raise ValueError(f"{where}: {value!r} is not one of {list(args)}")
        return value
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ValueError(f"{where}: expected {tp.__name__}, got {value!r}")
    return value


@dataclass(frozen=True)
class DecodeTuned:
    """A format's decode choices (`DecodePlan` says what each means): the Gluon kernel's, then the Triton kernels'."""

    gluon: bool
    registers: int  # the Gluon kernel's register cap from registers (0: none) ...
    ring_registers: int  # ... and through the int4 ring
    k_chains: Literal[1, 2]
    skip_rescale: bool
    offsets32: bool
    block_n: int
    num_stages: int
    dot_fp16: bool
    p_scale: bool
    tile_registers: int  # the Triton kernels' register cap (0: none)
    resident_per_sm: int  # their programs an SM holds, for the split rule
    warps: bool
    heads_n: bool
    int8_asm: bool
    pages_ahead: bool
    warp_page: bool


@dataclass(frozen=True)
class WriteTuned:
    lanes: Literal[0, 2, 4, 8, 16]
    packed: bool


@dataclass(frozen=True)
class FormatTuned:
    decode: DecodeTuned
    write: WriteTuned


@dataclass(frozen=True)
class PrefillTuned:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class TunedFile:
    """tuned/<device>.json: per KV format name (`KVFormat.name`), and the prefill tile per q dtype class."""

    device: str
    formats: dict[str, FormatTuned]
    prefill: dict[Literal["16bit", "fp32"], PrefillTuned]

    @classmethod
    def from_dict(cls, data: dict, where: str = "tuned file") -> TunedFile:
        """Checked field by field; a ValueError names the first field that is wrong."""
        return _checked(cls, data, where)

    def to_dict(self) -> dict:
        return asdict(self)


TUNED_FALLBACK = "nvidia_h200"


def tuned_file_name(device_name: str) -> str:
    return device_name.lower().replace(" ", "_").replace("-", "_")


@functools.cache
def _load_tuned(stem: str) -> TunedFile:
    text = (resources.files(__package__) / "tuned" / f"{stem}.json").read_text()
    return TunedFile.from_dict(json.loads(text), f"tuned/{stem}.json")


@functools.cache
def tuned_for_device(device: Device) -> TunedFile:
    """The device's tuned file, else the H200's (looked up once a device: plans are made on every launch)."""
    stem = tuned_file_name(device.name)
    has = (resources.files(__package__) / "tuned" / f"{stem}.json").is_file()
    return _load_tuned(stem if has else TUNED_FALLBACK)


def mixed_tuned_name(fmt: KVFormat) -> str:
    """The tuned entry a mixed format without one of its own takes: K8V4's for formats whose K and V differ, group-64
    INT4's for the group / e8m0 formats (the mixed kernels' choices depend on the format only through its bytes)."""
    return "k.int8-per_token+v.int4-per_token-asym" if fmt.split else "int4-per_token-asym-g64"


def format_tuned(fmt: KVFormat, device: Device) -> FormatTuned:
    """`fmt`'s entry in `device`'s tuned file; a format without one of its own takes its stand-in's."""
    tuned = tuned_for_device(device)
    if fmt.name not in tuned.formats and served_by_mixed(fmt):
        fmt = format_from_name(mixed_tuned_name(fmt))
    elif fmt.name not in tuned.formats and fmt.dynamic:
        # the tuned kernels' choices are per dtype / granularity / symmetry: the entry of fp16 scales serves bf16 and
        # fp32 ones (the plan functions check the scale dtype where a variant needs fp16 scales)
        fmt = dataclasses.replace(fmt, scale_dtype="float16")
    if fmt.name not in tuned.formats:
        raise KeyError(f"tuned/{tuned_file_name(tuned.device)}.json has no entry for KV format {fmt.name!r}; "
                       f"add one with benchmarks/tune.py")
    return tuned.formats[fmt.name]
