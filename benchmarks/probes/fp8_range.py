"""Where per-tensor FP8 KV loses accuracy on text it was not calibrated on: clipping or underflow?

For each text, one dense forward of the fp32 model (optionally rotated) records every layer's K and V
and counts, against the calibrated per-tensor e4m3 scale s (amax / 448): elements clipped
(|x| > 448 s), elements in e4m3's subnormal range (|x| < 2^-6 s: fewer than 3 mantissa bits), and the
round trip's relative error ||x - dq(q(x))|| / ||x||, all with runtime.kv_format's quantizer.

    python -m benchmarks.probes.fp8_range --model-dir DIR --calib DIR [--rotation hadamard] \
        --text builtin --text calibration/data/out_of_domain
"""

from __future__ import annotations

import argparse
import json

import torch

from calibration.calibrate import calibration_rotation, scales_for
from calibration.loading import load_model, load_tokenizer
from calibration.perplexity import eval_windows
from runtime.kv_format import KVFormat
from runtime.kv_quant import dequantize, quantize
from runtime.rotation import KVRotation

FMT = KVFormat("fp8_e4m3", "per_tensor")
MIN_NORMAL = 2.0**-6


def probe(model, windows: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> dict:
    acc = {w: {"n": 0, "clipped": 0, "subnormal": 0, "err2": 0.0, "x2": 0.0} for w in ("k", "v")}

    def observe(i, k, v):
        for w, x, s in (("k", k, k_scale[i]), ("v", v, v_scale[i])):
            a = acc[w]
            y = x.abs() / s
            a["n"] += x.numel()
            a["clipped"] += int((y > FMT.qmax).sum())
            a["subnormal"] += int((y < MIN_NORMAL).sum())
            a["err2"] += float((dequantize(quantize(x, FMT, s), FMT, s) - x).pow(2).sum())
            a["x2"] += float(x.pow(2).sum())

    for row in windows:
        model.forward_dense(row[None], observer=observe)
    return {w: {"clipped_frac": a["clipped"] / a["n"], "subnormal_frac": a["subnormal"] / a["n"],
                "rel_error": (a["err2"] / a["x2"]) ** 0.5} for w, a in acc.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--calib", required=True, help="a calibration directory (its rotation is used)")
    ap.add_argument("--text", action="append", default=[], help="'builtin' (held-out split) or a path; repeatable")
    ap.add_argument("--tokens", type=int, default=1024)
    args = ap.parse_args()
    rot = calibration_rotation(args.calib)
    rotation = KVRotation("hadamard", int(rot.split("-s")[1])) if rot != "none" else KVRotation()
    model = load_model(args.model_dir, rotation=rotation)
    tok = load_tokenizer(args.model_dir)
    k_scale, v_scale = scales_for(args.calib, FMT)
    out = {"rotation": rot, "texts": {}}
    for text in args.text or ["builtin"]:
        out["texts"][text] = probe(model, eval_windows(tok, args.tokens, 1024, text), k_scale, v_scale)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
