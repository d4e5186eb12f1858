"""Engine.score speed: 8 x 1024 tokens of SmolLM2 through the engine vs one dense forward of the same tokens.

The dense forward is runtime.model.LlamaModel.forward_dense over the [8, 1024]
batch (all logits, no cache): the cheapest way to get the same log-probabilities
without the engine. Engine.score runs prefill passes of `max_tokens_per_step`
tokens through the paged pool (write, then read). Both are timed side by side
in one process, alternating, best of `--repeats`, so a loaded machine disturbs
the ratio less than the absolute times.

    python -m benchmarks.score_speed [--model-dir DIR] [--formats fp32,int8:per_token] [--out results.json]
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch

from calibration.files import write_json_atomic
from calibration.perplexity import eval_windows
from runtime.engine import Engine
from runtime.engine_dir import load_tokenizer
from runtime.kv_format import KVFormat


def _fmt(text: str) -> KVFormat:
    dtype, _, gran = text.partition(":")
    sym = not gran.endswith("-asym")
    return KVFormat(dtype, gran.removesuffix("-asym") or "per_tensor", symmetric=sym)


def _time(fn, *a) -> float:
    t = time.perf_counter()
    fn(*a)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default=None, help="converted SmolLM2 (default: convert the builtin)")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--formats", default="fp32,int8:per_token,int4:per_token-asym")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp(prefix="kvq-score-")) / "model"
    if not args.model_dir:
        from builder.convert import convert_source  # benchmarks may use the builder

        model_dir.mkdir()
        convert_source("smollm2-135m", None, model_dir, "float32")
    ids = eval_windows(load_tokenizer(model_dir), args.windows * args.window, args.window)
    rows = []
    for name in args.formats.split(","):
        fmt = _fmt(name)
        eng = Engine.from_dir(model_dir, kv_format=fmt, dtype="float32", device="cpu",
                              num_blocks=-(-(2048 + 2 * args.window) // 16), block_size=16)
        try:
            seqs = [w.tolist() for w in ids]
            dense = score = float("inf")
            for _ in range(args.repeats):  # alternating, best of each
                dense = min(dense, _time(eng.model.forward_dense, ids))
                score = min(score, _time(eng.score, seqs))
        finally:
            eng.shutdown()
        row = {"kv_format": fmt.name, "tokens": int(ids.numel()), "score_s": round(score, 2),
               "dense_forward_s": round(dense, 2), "ratio": round(score / dense, 3)}
        print(row, flush=True)
        rows.append(row)
    res = {"rows": rows, "host": {"machine": platform.machine(), "torch": torch.__version__,
                                  "threads": torch.get_num_threads(), "repeats": args.repeats}}
    if args.out:
        write_json_atomic(Path(args.out), res)


if __name__ == "__main__":
    main()
