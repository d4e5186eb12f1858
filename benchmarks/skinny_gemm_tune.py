"""cuBLAS against kvq's Triton GEMV (runtime/kernels/skinny_gemm.py) at a model's decode shapes, M = 1..16.

Run by benchmarks/step_profile.py (--gemm-sweep) on one engine's weights: for every distinct weight shape
(QKV, O, gate/up, down, LM head) and M, the GPU time of one step's matmuls with that shape (every layer's
own weight, so the weights stream from HBM as in a step) through cuBLAS and through the GEMV at a few
tile sizes. Writes the tuned file the runtime's rule reads, `gemv_<gpu>.json`: per shape the largest M up
to which (from M = 1) the best GEMV tile beat cuBLAS by at least WIN; copy it into runtime/kernels/tuned/
to make Engine(fused_ops=True) use it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from benchmarks.step_components import time_ms
from runtime.batch_invariant import fast_linear
from runtime.kernels.skinny_gemm import gemv
from runtime.kernels.tuned_file import tuned_file_name

M_VALUES = (1, 2, 4, 8, 16)
TILES = ((16, 256), (32, 128), (16, 512), (64, 128))  # (block_n, block_k)
WIN = 0.97  # the GEMV must take at most this share of cuBLAS's time: a tie keeps cuBLAS


def sweep(engine, bandwidth_gbs: float, reps: int = 20) -> list[dict]:
    model = engine.model
    dev = model.device
    layers = [model.layer(i) for i in range(engine.cfg.num_layers)]
    weights = {"qkv": [la.qkv for la in layers], "o": [la.o for la in layers],
               "gate_up": [la.gate_up for la in layers], "down": [la.down for la in layers], "lm_head": [model.lm_head]}
    rows = []
    for name, ws in weights.items():
        n, k = ws[0].shape
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        for m in M_VALUES:
            x = torch.randn(m, k, device=dev).to(model.dtype)
            times = {"cublas": time_ms(lambda x=x, ws=ws: [fast_linear(x, w) for w in ws], dev, reps)}
            for bn, bk in TILES:
                try:
                    times[f"gemv {bn}x{bk}"] = time_ms(lambda x=x, bn=bn, bk=bk, ws=ws: [gemv(x, w, bn, bk) for w in ws],
                                                       dev, reps)
                except Exception as e:  # noqa: BLE001 - a tile that does not compile: the others still count
                    print(f"gemv {bn}x{bk} at {name} M={m}: {type(e).__name__}: {e}", flush=True)
            for impl, ms in times.items():
                rows.append({"kind": "gemm", "weight": name, "n": n, "k": k, "m": m, "impl": impl, "ms": ms,
                             "GBps": nbytes / ms / 1e6, "pct_of_bound": 100 * nbytes / (bandwidth_gbs * 1e6) / ms})
    return rows


def tuned_file(rows: list[dict]) -> dict:
    """Per (n, k): the largest M (from 1 up, without a loss between) where the best GEMV tile wins by WIN."""
    shapes = []
    for n, k in dict.fromkeys((r["n"], r["k"]) for r in rows):
        best_tile, max_m = None, 0
        for m in M_VALUES:
            mine = [r for r in rows if (r["n"], r["k"], r["m"]) == (n, k, m)]
            cublas = next(r["ms"] for r in mine if r["impl"] == "cublas")
            gemvs = [r for r in mine if r["impl"] != "cublas"]
            best = min(gemvs, key=lambda r: r["ms"], default=None)
            if best is None or best["ms"] > WIN * cublas:
                break
            max_m, best_tile = m, best_tile or best["impl"]
        if max_m:
            bn, bk = best_tile.split()[1].split("x")
            shapes.append({"n": n, "k": k, "max_m": max_m, "block_n": int(bn), "block_k": int(bk)})
    return {"why": "benchmarks/skinny_gemm_tune.py: the GEMV beat cuBLAS by >= 3% at every M up to max_m",
            "shapes": shapes}


def write_tuned(rows: list[dict], out: Path) -> Path:
    path = out / f"gemv_{tuned_file_name(torch.cuda.get_device_name())}.json"
    path.write_text(json.dumps(tuned_file(rows), indent=1) + "\n")
    return path
