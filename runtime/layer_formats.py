"""Per-layer KV formats: each decoder layer stores its K/V in its own KVFormat.

An engine carries one KVFormat per layer (`LayerFormats`, a tuple; a uniform
engine repeats one format). KVFormat is the unit "how one layer's K and V are
stored", so whatever a format can say about K and V separately comes with it.
The block manager's block ids are shared by every layer: block b of a sequence
is block b in every layer's pool, and each layer's pool holds that block in its
own bytes (runtime/runner.py).

On disk (engine directories):

    kv_format.json         uniform: the KVFormat fields, as for every engine;
                           mixed:   {"layers": [KVFormat fields, one per layer]}
    kv_scales.safetensors  uniform static: k_scale / v_scale [layers] or [layers, kv_heads];
                           mixed: k_scale.<i> / v_scale.<i> for each static layer i,
                           [] (per_tensor) or [kv_heads] (per_head)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .config import ModelConfig
from .errors import InputError, KvqError
from .kv_format import KVFormat, format_fields, kv_bytes_per_token

LayerFormats = tuple[KVFormat, ...]


def as_layer_formats(fmt: KVFormat | Sequence[KVFormat], num_layers: int) -> LayerFormats:
    """One format per layer: a single format is repeated; a sequence must name every layer."""
    if isinstance(fmt, KVFormat):
        return (fmt,) * num_layers
    formats = tuple(fmt)
    if len(formats) != num_layers or not all(isinstance(f, KVFormat) for f in formats):
        raise InputError(f"per-layer KV formats must give one KVFormat for each of the {num_layers} layers, "
                         f"got {len(formats)}; rebuild the engine (kvq build) for this model.")
    return formats


def uniform_format(formats: Sequence[KVFormat]) -> KVFormat | None:
    """The one format every layer shares, or None for a mixed engine."""
    first = formats[0]
    return first if all(f == first for f in formats) else None


def layer_runs(formats: Sequence[KVFormat]) -> list[tuple[int, int, KVFormat]]:
    """Maximal runs of consecutive layers with one format: (first, last, format)."""
    runs: list[tuple[int, int, KVFormat]] = []
    for i, f in enumerate(formats):
        if runs and runs[-1][2] == f:
            runs[-1] = (runs[-1][0], i, f)
        else:
            runs.append((i, i, f))
    return runs


def formats_name(formats: Sequence[KVFormat]) -> str:
    """A uniform engine's format name; a mixed one's layer runs, e.g. "L0-1:int8-per_token,L2-29:int4-per_token-asym"."""
    one = uniform_format(formats)
    if one is not None:
        return one.name
    return ",".join(f"L{a}" + (f"-{b}" if b > a else "") + f":{f.name}" for a, b, f in layer_runs(formats))


def bits_per_element(cfg: ModelConfig, formats: KVFormat | Sequence[KVFormat]) -> float:
    """Average stored bits per K/V element, scale metadata included (fp16 = 16)."""
    elements = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    return 8 * kv_bytes_per_token(cfg, formats) / elements


# --------------------------------------------------------------- kv_format.json
def formats_to_json(formats: Sequence[KVFormat]) -> dict[str, Any]:
    one = uniform_format(formats)
    return format_fields(one) if one is not None else {"layers": [format_fields(f) for f in formats]}


def format_from_fields(fields: Any, where: str) -> KVFormat:
    known = {f.name for f in dataclasses.fields(KVFormat)}
    if not isinstance(fields, Mapping):
        raise InputError(f"{where}: a KV format must be an object of the KVFormat fields {sorted(known)}.")
    try:
        return KVFormat(**{k: v for k, v in fields.items() if k in known})
    except KvqError as e:
        raise InputError(f"{where}: {e}") from None
    except TypeError as e:
        raise InputError(f"{where}: {e}; expected the KVFormat fields {sorted(known)}.") from None


def formats_from_json(data: Mapping[str, Any], num_layers: int, where: str) -> LayerFormats:
    if "layers" not in data:
        return (format_from_fields(data, where),) * num_layers
    layers = data["layers"]
    if not isinstance(layers, list) or len(layers) != num_layers:
        raise InputError(f"{where}: 'layers' must list one KV format for each of the model's {num_layers} layers, "
                         f"got {len(layers) if isinstance(layers, list) else type(layers).__name__}; "
                         "rebuild the engine (kvq build).")
    return tuple(format_from_fields(f, f"{where}: layers[{i}]") for i, f in enumerate(layers))


# ------------------------------------------------------------ kv_scales.safetensors
def scale_shape(fmt: KVFormat, cfg: ModelConfig) -> tuple[int, ...]:
    """One layer's static scale shape: [] per_tensor, [kv_heads] per_head."""
    return () if fmt.granularity == "per_tensor" else (cfg.num_kv_heads,)


def scales_to_tensors(formats: Sequence[KVFormat], k: Sequence[torch.Tensor | None],
                      v: Sequence[torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """The kv_scales.safetensors tensors for per-layer static scales (None for dynamic layers)."""
    one = uniform_format(formats)
    if one is not None:
        return {"k_scale": torch.stack(list(k)).float().contiguous(),
                "v_scale": torch.stack(list(v)).float().contiguous()} if one.static else {}
    out = {}
    for i, f in enumerate(formats):
        if f.static:
            out[f"k_scale.{i}"] = k[i].float().contiguous()
            out[f"v_scale.{i}"] = v[i].float().contiguous()
    return out


def scales_from_tensors(formats: Sequence[KVFormat], t: Mapping[str, Any], cfg: ModelConfig,
                        where: str) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Per-layer (k, v) static scales from either layout, each checked for shape and value."""
    out: tuple[list, list] = ([], [])
    uniform = "k_scale" in t or "v_scale" in t
    for i, f in enumerate(formats):
        for which, dst in (("k_scale", out[0]), ("v_scale", out[1])):
            if not f.static:
                dst.append(None)
                continue
            key = which if uniform else f"{which}.{i}"
            s = t.get(key)
            if s is None:
                raise InputError(f"{where}: {key!r} is missing; re-run calibration for {f.name} (layer {i}).")
            s = torch.as_tensor(s, dtype=torch.float32)
            want = scale_shape(f, cfg)
            if uniform:
                if tuple(s.shape) != (cfg.num_layers, *want):
                    raise InputError(f"{where}: {key} has shape {list(s.shape)}, {f.granularity} needs "
                                     f"{[cfg.num_layers, *want]} (layers[, kv_heads]); the scales were calibrated "
                                     "for another granularity or model.")
                s = s[i]
            if tuple(s.shape) != want:
                raise InputError(f"{where}: {key} (layer {i}) has shape {list(s.shape)}, {f.granularity} needs "
                                 f"{list(want)}; the scales were calibrated for another granularity or model.")
            if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
                raise InputError(f"{where}: {key} has non-positive or non-finite values; re-run calibration.")
            dst.append(s)
    return out
