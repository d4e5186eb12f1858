"""The `calibrate` stage: sample data -> K/V statistics -> scales for every static format.

One calibration serves every engine of a model: statistics are collected once
and `kv_scales.safetensors` holds the chosen policy's scales for every static
dtype x granularity (`{dtype}.{granularity}.k_scale` / `.v_scale`, fp32,
`[layers]` or `[layers, kv_heads]`), plus raw amax (`amax.k`, `amax.v`
`[layers, kv_heads]`). `kv_stats.safetensors` keeps the full statistics, so
`scales_for` can derive another policy's scales later without new forward
passes. `calibration.json` records what was measured and from which samples.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from runtime.config import ModelConfig
from runtime.errors import InputError
from runtime.kv_format import KVFormat
from runtime.rotation import NO_ROTATION, KVRotation

from . import corpus
from .files import save_tensors_atomic, write_json_atomic
from .loading import is_synthetic, load_model, load_tokenizer
from .policies import DEFAULT_PERCENTILE, check_policy, scales_from_stats, static_formats
from .progress import work_progress
from .stats import KV, KVStats, collect_layer_streaming, collect_whole_model, outlier_channels

SCALES_FILE, STATS_FILE, REPORT_FILE = "kv_scales.safetensors", "kv_stats.safetensors", "calibration.json"


# ------------------------------------------------------------------- data
def calibration_windows(model_dir: str | Path, cfg: ModelConfig, dataset: str, num_samples: int,
                        seq_len: int, seed: int) -> tuple[torch.Tensor, dict]:
    """Token windows [num_samples, seq_len] and a description of where they came from.

    A synthetic model (random weights, no tokenizer) calibrates on random token
    ids from the seed: its statistics only need to have the right shape.
    """
    if seq_len > cfg.max_position_embeddings:
        raise InputError(f"seq_len {seq_len} exceeds the model's {cfg.max_position_embeddings} positions; lower it.")
    if is_synthetic(model_dir):
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, cfg.vocab_size, (num_samples, seq_len), generator=g)
        return ids, {"dataset": "random token ids (synthetic model)", "seed": seed}
    docs = corpus.load_documents(dataset, "calibration")
    tw = corpus.token_windows(load_tokenizer(model_dir), docs, num_samples, seq_len, seed)
    desc = corpus.builtin_description() if dataset == corpus.BUILTIN else str(Path(dataset).resolve())
    return tw.ids, {"dataset": desc, "seed": seed, "documents": len(docs), "samples": tw.describe()}


# ------------------------------------------------------------------ stage
def collect_stats(model_dir: str | Path, windows: torch.Tensor, streaming: bool, device: str = "cpu",
                  dtype: str | None = None, progress: bool = False, rotation: KVRotation = NO_ROTATION) -> KVStats:
    """K/V statistics of every layer over `windows`; progress: a per-batch rich bar on stderr.
    rotation: the engine's KV rotation, so the statistics describe the K/V it stores."""
    model = load_model(model_dir, device=device, dtype=dtype, streaming=streaming, rotation=rotation)
    c = model.cfg
    stats = KVStats(c.num_layers, c.num_kv_heads, c.head_dim)
    run = collect_layer_streaming if streaming else collect_whole_model
    samples = windows.shape[0] * (c.num_layers if streaming else 1)  # streaming passes every sample per layer
    with work_progress(progress) as bars:
        return run(model, windows, stats, advance=bars.task("calibration forward", samples, "samples"))


def _round(t: torch.Tensor, nd: int = 6) -> list:
    return [round(float(x), nd) for x in t.flatten()] if t.dim() <= 1 else [_round(r, nd) for r in t]


def run_calibration(model_dir: str | Path, out_dir: str | Path, dataset: str = "builtin", num_samples: int = 64,
                    seq_len: int = 512, policy: str = "max", seed: int = 0, streaming: bool = False,
                    device: str = "cpu", percentile: float = DEFAULT_PERCENTILE,
                    dtype: str | None = None, progress: bool = False, rotation: KVRotation = NO_ROTATION) -> dict:
    """Calibrate `model_dir` and write kv_stats / kv_scales / calibration.json into `out_dir`.

    rotation: the KV rotation of the engines these scales are for (scales describe what is stored).

    `out_dir` must exist (the pipeline hands in a temporary directory it later
    renames). Returns the facts for the stage manifest.
    """
    check_policy(policy)
    out = Path(out_dir)
    if not out.is_dir():
        raise InputError(f"output directory {out} does not exist.")
    cfg = ModelConfig.from_dir(model_dir)
    t0 = time.perf_counter()
    windows, data_desc = calibration_windows(model_dir, cfg, dataset, num_samples, seq_len, seed)
    t1 = time.perf_counter()
    stats = collect_stats(model_dir, windows, streaming, device, dtype, progress, rotation)
    t2 = time.perf_counter()

    scales: dict[str, torch.Tensor] = {}
    per_format: dict[str, Any] = {}
    for fmt in static_formats():
        k, v = scales_from_stats(stats, fmt, policy, percentile)
        key = f"{fmt.dtype}.{fmt.granularity}"
        scales[f"{key}.k_scale"], scales[f"{key}.v_scale"] = k.scale, v.scale
        per_format[key] = {
            f"{n}_{field}": _round(getattr(r, attr))
            for n, r in (("k", k), ("v", v))
            for field, attr in (("clip", "clip"), ("rel_error", "rel_error"), ("rel_error_at_max", "rel_error_at_max"))
        }
    head_amax = stats.head_amax()
    scales["amax.k"], scales["amax.v"] = head_amax[:, 0].contiguous(), head_amax[:, 1].contiguous()
    t3 = time.perf_counter()

    save_tensors_atomic(out / STATS_FILE, stats.tensors())
    save_tensors_atomic(out / SCALES_FILE, scales)
    report = {
        "model_dir": str(Path(model_dir).resolve()),
        "policy": policy,
        "percentile": percentile if policy == "percentile" else None,
        "scale_convention": "dequantization scale s = clip / qmax (x ~= q * s)",
        "mode": "layer-streaming" if streaming else "whole-model",
        "kv_rotation": rotation.to_json(cfg.head_dim),
        "device": device,
        "dtype": dtype or "model default",
        "num_samples": num_samples,
        "seq_len": seq_len,
        "tokens_per_layer": int(stats.tokens[0]),
        "data": data_desc,
        "layers": [
            {"layer": i, **{f"{n}_amax_per_head": _round(head_amax[i, w]) for w, n in enumerate(KV)}}
            for i in range(cfg.num_layers)
        ],
        "formats": per_format,
        "error_note": "rel_error: histogram estimate of E[(x - dequant(quant(x)))^2] / E[x^2] on the calibration data",
        "outlier_channels": outlier_channels(stats),
        "timing_s": {"data": round(t1 - t0, 3), "forward": round(t2 - t1, 3), "scales": round(t3 - t2, 3),
                     "total": round(t3 - t0, 3)},
        "host": {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__},
    }
    write_json_atomic(out / REPORT_FILE, report)
    return {
        "outputs": [STATS_FILE, SCALES_FILE, REPORT_FILE],
        "policy": policy, "num_samples": num_samples, "seq_len": seq_len, "seed": seed,
        "dataset": dataset, "streaming": streaming, "seconds": round(t3 - t0, 3), "kv_rotation": rotation.name,
    }


# ----------------------------------------------------- reading it back
def _load(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise InputError(f"{path} does not exist; run `kvq calibrate` for this model first.")
    try:
        return load_file(str(path))
    except Exception as e:  # safetensors raises several types for a corrupt file
        raise InputError(f"{path} is not a readable safetensors file ({e}); re-run `kvq calibrate`.") from None


def calibration_policy(calib_dir: str | Path) -> str:
    p = Path(calib_dir) / REPORT_FILE
    try:
        return json.loads(p.read_text())["policy"]
    except (OSError, json.JSONDecodeError, KeyError) as e:
        raise InputError(f"{p} is missing or unreadable ({e}); re-run `kvq calibrate`.") from None


def calibration_rotation(calib_dir: str | Path) -> str:
    """The KV rotation (its name) the statistics of `calib_dir` were collected under."""
    p = Path(calib_dir) / REPORT_FILE
    try:
        rot = json.loads(p.read_text()).get("kv_rotation") or {}
    except (OSError, json.JSONDecodeError) as e:
        raise InputError(f"{p} is missing or unreadable ({e}); re-run `kvq calibrate`.") from None
    return KVRotation(rot.get("kind", "none"), rot.get("seed")).name


def scales_for(calib_dir: str | Path, fmt: KVFormat, policy: str | None = None,
               percentile: float = DEFAULT_PERCENTILE) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_scale, v_scale) for a static format, fp32 `[layers]` or `[layers, kv_heads]`.

    The calibration's own policy is read from kv_scales.safetensors; any other
    policy is derived from kv_stats.safetensors.
    """
    if not fmt.static:
        raise InputError(f"{fmt.name} needs no calibrated scales.")
    d = Path(calib_dir)
    if policy is None or policy == calibration_policy(d):
        t = _load(d / SCALES_FILE)
        key = f"{fmt.dtype}.{fmt.granularity}"
        if f"{key}.k_scale" not in t:
            raise InputError(f"{d / SCALES_FILE} has no scales for {fmt.name}; re-run `kvq calibrate`.")
        return t[f"{key}.k_scale"], t[f"{key}.v_scale"]
    k, v = scales_from_stats(KVStats.from_tensors(_load(d / STATS_FILE)), fmt, policy, percentile)
    return k.scale, v.scale


def layer_amax(calib_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-layer (max over KV heads) K and V amax, `[layers]` fp32: TensorRT-LLM's per-tensor inputs."""
    t = _load(Path(calib_dir) / SCALES_FILE)
    return t["amax.k"].amax(dim=-1), t["amax.v"].amax(dim=-1)
