"""The per-layer part of benchmarks/served_vs_inprocess.py: which engines it serves, and their static scales.

A per-layer choice comes from the search stage's outputs (docs/layer-precision.md): `recipe_kv.yaml`
(`kv.layers`, by layer range, the recipe syntax) or `kv_format.json` (`{"layers": [...]}`, or one
format for all layers). The served comparison is that choice against each format it uses as a
uniform engine, and unquantized BF16, on the same synthetic geometry and concurrency.

Synthetic engines have no calibration of their own, so static layers (per_tensor / per_head) get
scales from a short calibration of the same synthetic weights (calibration.calibrate, random token
ids): the scales fit the values the engine stores, so no layer saturates or decodes garbage; they
decide nothing about speed, which is what this comparison measures.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from runtime.errors import InputError, KvqError
from runtime.kv_format import KVFormat
from runtime.layer_formats import LayerFormats, formats_from_json, scales_to_tensors, uniform_format

BF16 = KVFormat(dtype="bf16")
CALIBRATION_SAMPLES, CALIBRATION_LEN = 4, 128


def read_layer_formats(path: Path, num_layers: int) -> LayerFormats:
    """One KV format per layer from a recipe_kv.yaml / recipe (kv.layers) or a kv_format.json."""
    if not path.is_file():
        raise InputError(f"--kv-layers {path} does not exist; pass the search stage's recipe_kv.yaml or "
                         "kv_format.json (engines/<recipe>/search/).")
    if path.suffix == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise InputError(f"--kv-layers {path} is not JSON ({e}); pass a kv_format.json.") from None
        if not isinstance(data, dict):
            raise InputError(f"--kv-layers {path}: a kv_format.json holds an object (KVFormat fields or 'layers').")
        return formats_from_json(data, num_layers, str(path))
    import yaml

    from recipes.kv_section import parse_layer_ranges

    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise InputError(f"--kv-layers {path} is not YAML ({e}); pass a recipe_kv.yaml.") from None
    layers = (data.get("kv") or {}).get("layers") if isinstance(data, dict) else None
    if not isinstance(layers, dict):
        raise InputError(f"--kv-layers {path} has no kv.layers mapping (e.g. kv: {{layers: {{'0-29': "
                         "int8-per_token}}); pass the search stage's recipe_kv.yaml.")
    try:
        return parse_layer_ranges(layers, num_layers, where=f"{path}: kv.layers")
    except (ValueError, KvqError) as e:
        raise InputError(str(e)) from None


def comparison(chosen: LayerFormats, uniform: Sequence[KVFormat] | None = None) -> list[tuple[str, LayerFormats]]:
    """(label, per-layer formats) to serve: the choice, then BF16 and each format it uses, uniform."""
    n = len(chosen)
    if uniform is None:
        uniform = [BF16] + [f for f in dict.fromkeys(chosen) if f != BF16]
    rows = [] if uniform_format(chosen) is not None else [("per-layer", chosen)]
    return rows + [(f.name, (f,) * n) for f in dict.fromkeys(uniform)]


def static_scales(engine_dir: Path, formats: LayerFormats, calib: Path, device: str) -> dict | None:
    """kv_scales.safetensors tensors for the static layers of `formats`; the synthetic weights are
    calibrated on random ids once into `calib` (every engine of one preset has the same weights).
    None: no static layer."""
    if not any(f.static for f in formats):
        return None
    from calibration.calibrate import run_calibration, scales_for

    if not (calib / "kv_scales.safetensors").is_file():
        calib.mkdir(parents=True, exist_ok=True)
        run_calibration(engine_dir, calib, num_samples=CALIBRATION_SAMPLES, seq_len=CALIBRATION_LEN, device=device)
        if device.startswith("cuda"):  # the calibration's model is gone: give its memory to the server
            import torch

            torch.cuda.empty_cache()
    k, v = [None] * len(formats), [None] * len(formats)
    for fmt in {f for f in formats if f.static}:
        ks, vs = scales_for(calib, fmt)
        for i, f in enumerate(formats):
            if f == fmt:
                k[i], v[i] = ks[i], vs[i]
    return scales_to_tensors(formats, k, v)


def markdown(rows: list[dict], machine: str) -> str:
    """The per-layer comparison: decode speed of each served engine against the per-layer choice's."""
    if not rows:
        return ""
    r0 = rows[0]
    head = (f"\n## Per-layer KV formats served: {r0['preset']} geometry (synthetic weights), {r0['concurrency']} "
            f"concurrent requests, {r0['prompt_len']} prompt + {r0['output_len']} output tokens, greedy\n\n"
            f"{machine}\n\n| engine | KV bytes/token | path | decode tok/s | vs in-process | ITL p50 / p99 ms "
            "| vs bf16 | TTFT p50 ms | attention |\n|---|---:|---|---:|---:|---:|---:|---:|---|\n")
    f = lambda v, p=1: "-" if v is None or v != v else f"{v:,.{p}f}"  # noqa: E731
    bf16 = {r["path"]: r["decode_tokens_per_s"] for r in rows if r["engine"] == BF16.name}
    body = "".join(
        f"| {r['engine']} | {f(r.get('kv_bytes_per_token'), 0)} | {r['path']} | {f(r['decode_tokens_per_s'])} "
        f"| {f(100 * r['decode_vs_inprocess'])}% | {f(r['itl_ms_p50'], 2)} / {f(r['itl_ms_p99'], 2)} "
        f"| {f(100 * r['decode_tokens_per_s'] / bf16[r['path']]) + '%' if bf16.get(r['path']) else '-'} "
        f"| {f(r['ttft_ms_p50'])} | {r.get('attention', '-')} |\n" for r in rows)
    chosen = next((r["kv_format"] for r in rows if r["engine"] == "per-layer"), None)
    return head + body + (f"\nper-layer = {chosen}\n" if chosen else "")
