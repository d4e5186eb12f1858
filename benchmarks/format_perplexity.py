"""One KV format's perplexity through the engine against the baseline of an earlier kv_formats_accuracy run.

The unquantized baseline of a kv_formats_accuracy run does not depend on the formats it measured (same model
directory, windows, batch-invariant CPU engine), so a format can be scored alone against it: held-out and the
run's extra text, with that run's perplexity settings. Writes <out>/<name>.json.

    python -m benchmarks.format_perplexity --format k.int4-per_channel-asym+v.int4-per_token-asym \\
        --rotation hadamard --baseline benchmarks/results/kv_formats_bundled.json --out benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from calibration.engine_check import evaluation_engine
from calibration.files import write_json_atomic
from calibration.loading import load_model, load_tokenizer
from calibration.perplexity import eval_windows, perplexity
from runtime.kv_format import format_from_name
from runtime.rotation import NO_ROTATION, KVRotation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--format", required=True)
    ap.add_argument("--rotation", choices=["none", "hadamard"], default="none")
    ap.add_argument("--baseline", required=True, help="a kv_formats_accuracy result (.json)")
    ap.add_argument("--text", choices=["all", "held_out", "extra"], default="all",
                    help="score only the held-out text or only the run's extra text (two processes in parallel)")
    ap.add_argument("--out", default="benchmarks/results")
    args = ap.parse_args()
    t0 = time.perf_counter()
    base = json.loads(Path(args.baseline).read_text())
    s, model_dir = base["settings"], base["model_dir"]
    fmt = format_from_name(args.format)
    rot = KVRotation("hadamard", 0) if args.rotation == "hadamard" else NO_ROTATION
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, device="cpu", rotation=rot)
    texts = {}
    if args.text != "extra":
        texts["held_out"] = eval_windows(tok, s["perplexity_tokens"], s["perplexity_window"], s["eval_data"])
    for p in s["extra_eval_data"] if args.text != "held_out" else []:
        texts[p] = eval_windows(tok, s["perplexity_tokens"], s["perplexity_window"], p, field="extra_eval_data")
    eng = evaluation_engine(model, model_dir, fmt, longest=s["perplexity_window"], batch=8,
                            batch_invariant=s["batch_invariant"])
    res = {"format": fmt.name, "rotation": rot.name, "bits_per_element": fmt.bits_per_element(model.cfg.head_dim),
           "baseline_run": args.baseline, "settings": s, "attention": eng.stats.attention, "perplexity": {}}
    try:
        for name, w in texts.items():
            ppl = perplexity(eng, w)
            ref = base["baseline"]["perplexity"] if name == "held_out" else base["baseline"]["perplexity_extra"][name]
            res["perplexity"][name] = {**ppl, "baseline": ref["perplexity"],
                                       "change_pct": 100 * (ppl["perplexity"] / ref["perplexity"] - 1)}
            print(name, f"{ppl['perplexity']:.4f}", f"{res['perplexity'][name]['change_pct']:+.2f}%", flush=True)
    finally:
        eng.shutdown()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    stem = fmt.name + (f"+{rot.name}" if rot.active else "") + ("" if args.text == "all" else f"_{args.text}")
    write_json_atomic(Path(args.out) / f"perplexity_{stem}.json", res)


if __name__ == "__main__":
    main()
