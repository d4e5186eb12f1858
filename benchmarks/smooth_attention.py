"""SmoothAttention (QServe) for 4-bit keys on SmolLM2-135M: per-channel K scaling folded into q/k_proj.

Keys have a few outlier channels; a per-token INT4 scale is set by them, so the other channels lose
most of their levels. SmoothAttention divides K's channel j by s_j = amax_j^alpha and multiplies q's
by the same s_j, in the projections' weights (q.k unchanged, no cost per step). RoPE mixes channel
j with j + head_dim/2, so a pair shares one factor (the larger amax of the two), which makes the
scaling commute with RoPE and the fold exact.

This measures it through the engine -- a smoothed copy of the converted model, scored by
calibration.evaluate.run_evaluation like every engine -- for INT4 per-token asym with and without
the Hadamard rotation, against the same engines on the unsmoothed model:

    python -m benchmarks.smooth_attention --out benchmarks/results [--alpha 0.5] [--ppl-tokens 8192]

Writes <out>/smooth_attention.json and .md.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from calibration.calibrate import STATS_FILE, run_calibration
from calibration.evaluate import EngineKV, EvalSettings, run_evaluation
from calibration.files import write_json_atomic, write_text_atomic
from runtime.config import ModelConfig
from runtime.kv_format import KVFormat
from runtime.rotation import KVRotation

INT4 = KVFormat("int4", "per_token", False)


def smoothing_factors(channel_amax_k: torch.Tensor, alpha: float) -> torch.Tensor:
    """[layers, kv_heads, D] post-RoPE K amax -> s [layers, kv_heads, D], shared by RoPE pairs, geometric
    mean 1 per head (so K and q keep their overall size)."""
    half = channel_amax_k.shape[-1] // 2
    a = channel_amax_k.clamp_min(1e-6).double()
    pair = torch.maximum(a[..., :half], a[..., half:])
    s = torch.cat((pair, pair), -1) ** alpha
    return s / s.log().mean(-1, keepdim=True).exp()


def write_smoothed_model(src: Path, dst: Path, s: torch.Tensor) -> None:
    """A copy of the converted model with q_proj rows x s and k_proj rows / s (GQA: a query head takes
    its KV head's factors)."""
    cfg = ModelConfig.from_dir(src)
    dst.mkdir(parents=True)
    files = [p for p in src.iterdir() if p.is_file() and p.suffix != ".safetensors" and p.name != "manifest.json"]
    for p in files:
        shutil.copy2(p, dst / p.name)
    for shard in src.glob("*.safetensors"):
        t = load_file(str(shard))
        for i in range(cfg.num_layers):
            q, k = f"model.layers.{i}.self_attn.q_proj.weight", f"model.layers.{i}.self_attn.k_proj.weight"
            if q in t:
                f = s[i].repeat_interleave(cfg.group_size, 0).reshape(-1, 1)
                t[q] = (t[q].double() * f).to(t[q].dtype)
            if k in t:
                t[k] = (t[k].double() / s[i].reshape(-1, 1)).to(t[k].dtype)
        save_file(t, str(dst / shard.name), metadata={"format": "pt"})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--model-dir", default=None, help="a converted SmolLM2 directory (default: convert the builtin)")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--greedy-prompts", type=int, default=8)
    ap.add_argument("--passkey-lengths", default="320,1024,3072")
    ap.add_argument("--passkey-trials", type=int, default=20)
    ap.add_argument("--ood", default=None, help="out-of-domain text scored for perplexity too")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--calib-samples", type=int, default=64, help="x 512 tokens for the channel amax")
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kvq-smooth-"))
    model_dir = Path(args.model_dir) if args.model_dir else work / "model"
    if not args.model_dir:
        from builder.convert import convert_source

        model_dir.mkdir()
        convert_source("smollm2-135m", None, model_dir, "float32")
    calib = work / "calib"
    calib.mkdir()
    run_calibration(model_dir, calib, num_samples=args.calib_samples, seq_len=512, policy="max", seed=0, device=args.device)
    amax_k = load_file(str(calib / STATS_FILE))["channel_amax"][:, 0]
    s = smoothing_factors(amax_k, args.alpha)
    smoothed = work / "smoothed"
    write_smoothed_model(model_dir, smoothed, s)
    settings = EvalSettings(perplexity_tokens=args.ppl_tokens, greedy_prompts=args.greedy_prompts,
                            greedy_tokens=args.greedy_tokens,
                            passkey_lengths=[int(x) for x in args.passkey_lengths.split(",")],
                            passkey_trials=args.passkey_trials, attention_tokens=256, engine_greedy=False,
                            extra_eval_data=[args.ood] if args.ood else [])
    hadamard = KVRotation("hadamard", 0)
    res = {}
    for label, d in (("plain", model_dir), (f"smooth-a{args.alpha:g}", smoothed)):
        engines = [EngineKV(f"{label}/{INT4.name}", INT4), EngineKV(f"{label}/{INT4.name}+{hadamard.name}", INT4,
                                                                      rotation=hadamard)]
        res[label] = run_evaluation(d, engines, None, settings, device=args.device, progress=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = ["| model | engine | Δ ppl held-out | Δ ppl out-of-domain | greedy | passkey |", "|---|---|---|---|---|---|"]
    for label, r in res.items():
        for name, e in r["engines"].items():
            o = next(iter(e.get("perplexity_extra", {}).values()), None)
            ood = f"{o['change_pct']:+.2f}%" if o else "—"
            lines.append(f"| {label} | {name} | {e['perplexity']['change_pct']:+.2f}% | {ood} | "
                         f"{e['greedy']['agreement']:.1%} | {e['passkey']['found']}/{e['passkey']['trials']} |")
    table = "\n".join(lines) + "\n"
    write_json_atomic(out / "smooth_attention.json", {"alpha": args.alpha, "results": res, "command": " ".join(sys.argv),
                                                       "wall_s": round(time.perf_counter() - t0, 1),
                                                       "threads": torch.get_num_threads(), "cpus": os.cpu_count()})
    write_text_atomic(out / "smooth_attention.md", "# SmoothAttention for INT4 keys (SmolLM2-135M, engine)\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
