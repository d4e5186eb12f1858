"""Which positions flip their top-1 token under quantized KV: the baseline's top-2 margin at the flips.

Top-1 agreement (calibration/accuracy.py top1_agreement) over every scored position of the held-out text, in the
dense simulation (calibration.kvsim: the engine's formats and scales on the dense path, so full logits are at
hand), per format: the rate with its Wilson 95% interval, how many flips land on the baseline's second choice,
and the flip rate by the baseline's top-2 log-probability margin (a near-tie flips on any perturbation).

    python -m benchmarks.top1_flips --model-dir DIR --ppl-tokens 8192 [--device cuda] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from calibration.accuracy import top1_agreement
from calibration.files import write_json_atomic
from calibration.kvsim import DenseScorer, KVRoundTrip
from calibration.loading import load_model, load_tokenizer
from calibration.perplexity import eval_windows
from runtime.kv_format import KVFormat
from runtime.rotation import NO_ROTATION, KVRotation

HADAMARD = KVRotation("hadamard", 0)
# (name, format, rotation): the formats of benchmarks/kv_formats_accuracy.py --set agreement
FORMATS = [
    ("k8v4-g32+rot", KVFormat("int8", "per_token", True, "float16", 0, "int4", False, 32), HADAMARD),
    ("int8+rot", KVFormat("int8", "per_token"), HADAMARD),
    ("fp8", KVFormat("fp8_e4m3", "per_token"), NO_ROTATION),
]
MARGIN_EDGES = (0.0, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, float("inf"))  # nats between the baseline's top two


def top2(scorer: DenseScorer, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per scored position (windows in order): top-1 token, top-2 token, log-probability margin between them."""
    t1, t2, gap = [], [], []
    for row in windows:
        lp = torch.log_softmax(scorer.logits(row)[:-1].double(), -1)
        v, i = lp.topk(2, dim=-1)
        t1.append(i[:, 0].cpu())
        t2.append(i[:, 1].cpu())
        gap.append((v[:, 0] - v[:, 1]).cpu())
    return torch.cat(t1), torch.cat(t2), torch.cat(gap)


def flip_report(base: tuple[torch.Tensor, ...], top1: torch.Tensor) -> dict:
    b1, b2, gap = base
    flip = top1 != b1
    bins = []
    for lo, hi in zip(MARGIN_EDGES, MARGIN_EDGES[1:]):
        m = (gap >= lo) & (gap < hi)
        bins.append({"margin_nats": [lo, hi], "positions": int(m.sum()), "flips": int((flip & m).sum())})
    return {**top1_agreement(b1, top1), "flips": int(flip.sum()),
            "flips_to_baseline_second": int((flip & (top1 == b2)).sum()),
            "flip_margin_median_nats": float(gap[flip].median()) if flip.any() else None,
            "position_margin_median_nats": float(gap.median()), "by_margin": bins}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    windows = eval_windows(load_tokenizer(args.model_dir), args.ppl_tokens, 1024)
    models = {NO_ROTATION: load_model(args.model_dir, device=args.device)}
    base = top2(DenseScorer(models[NO_ROTATION]), windows)
    res = {"ppl_tokens": args.ppl_tokens, "positions": int(base[0].numel()), "formats": {}}
    for name, fmt, rot in FORMATS:
        if rot not in models:
            models[rot] = load_model(args.model_dir, device=args.device, rotation=rot)
        m = models[rot]
        top1 = top2(DenseScorer(m, KVRoundTrip(fmt, m.cfg.num_layers)), windows)[0]
        res["formats"][name] = {"kv_format": fmt.name, "rotation": rot.name, **flip_report(base, top1)}
        r = res["formats"][name]
        print(name, f"{r['agreement']:.2%}", r["ci95"], "flips", r["flips"], "to 2nd", r["flips_to_baseline_second"],
              "median flip margin", r["flip_margin_median_nats"], flush=True)
        write_json_atomic(Path(args.out), res)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
