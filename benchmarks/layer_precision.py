"""Per-layer KV formats on SmolLM2-135M: the automatic choice's bytes against the best uniform format.

One run: convert the builtin SmolLM2 (or --model-dir), calibrate static scales on the built-in corpus
(64 x 512 tokens, `max` policy), then for each perplexity budget choose the per-layer formats through the
engine (calibration/budget_search.py: uniform candidates checked first, then a verified descent from the
smallest that fits; sensitivities shared by the budgets that start from the same format) and score the
choice and every candidate as a uniform format on two held-out texts: the built-in corpus's evaluation
split and an out-of-domain text. A budget is met on a text when the perplexity
change against unquantized KV is at most the budget; the best uniform format of a budget is the
smallest one that meets it on both texts. --speed also times greedy decode through the engine for
each choice and each uniform format at one concurrency, in the same process (tokens/s).

    python -m benchmarks.layer_precision --device cuda --out benchmarks/results \\
        [--budgets 0.5,1,3] [--formats fp16,int8-per_head,...] [--eval-tokens 8192] [--ood PATH] [--speed]

Writes <out>/layer_precision.jsonl (one row per budget x configuration) and layer_precision.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from calibration.budget_search import VALIDATION_MARGIN, checks_to_json, search
from calibration.calibrate import calibration_windows, run_calibration, scales_for
from calibration.layer_search import EngineScorer, Sensitivity, heldout_change, ladder, layer_scales
from calibration.loading import load_model, load_tokenizer
from calibration.perplexity import eval_windows
from recipes.kv_section import DEFAULT_SEARCH_FORMATS, layer_ranges
from runtime.config import ModelConfig
from runtime.engine_dir import parse_kv_format_name
from runtime.layer_formats import bits_per_element, formats_name

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_OOD = ROOT / "calibration" / "data" / "out_of_domain"  # public-domain / GPL texts shipped with kvq


def default_ood() -> Path:
    if SHIPPED_OOD.is_dir():
        return SHIPPED_OOD
    import os

    return Path(os.__file__).parent / "LICENSE.txt"  # the Python license: legal English, on every machine


def decode_speed(model, model_dir, formats, scales, concurrency: int, prompt_len: int, new_tokens: int) -> float:
    """Greedy decode tokens/s of `concurrency` requests through an engine of these per-layer formats."""
    from calibration.engine_check import evaluation_engine
    from runtime.sampling import SamplingParams

    k, v = layer_scales(formats, scales)
    eng = evaluation_engine(model, model_dir, formats, k, v, longest=prompt_len + new_tokens, batch=concurrency,
                            batch_invariant=False)
    try:
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(3, model.cfg.vocab_size, (concurrency, prompt_len), generator=g).tolist()
        sp = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        eng.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (compiles, graphs)
        t0 = time.perf_counter()
        eng.generate(prompts, sp)
        return concurrency * new_tokens / (time.perf_counter() - t0)
    finally:
        eng.shutdown()


def markdown(meta: dict, rows: list[dict]) -> str:
    texts = meta["texts"]
    lines = [f"# Per-layer KV formats on {meta['model']}", "",
             f"Device {meta['device']}, torch {meta['torch']}, fp32 model; sensitivity on {meta['num_samples']} x "
             f"{meta['seq_len']} calibration tokens, uniform candidates and descent steps checked on "
             f"{meta['validation_samples']} more windows against {meta['margin']:g} x budget ({meta['engine_runs']} "
             f"engine runs for the searches, {meta['wall_s']:.0f} s wall in all), KV rotation {meta['rotation']}; "
             "held-out: "
             + ", ".join(f"{n} ({t['tokens']} tokens, {t['source']})" for n, t in texts.items())
             + f". Candidates: {', '.join(meta['formats'])}.", "",
             "| budget | KV | bytes/token | bits/element | " + " | ".join(f"Δ ppl {n}" for n in texts)
             + " | meets | vs best uniform |" + (" tok/s |" if meta.get("speed") else ""),
             "|---|---|---|---|" + "---|" * len(texts) + "---|---|" + ("---|" if meta.get("speed") else "")]
    for r in rows:
        budget = "—" if r["budget_pct"] is None else f"+{r['budget_pct']:g}%"
        cells = " | ".join(f"{r['ppl_change_pct'][n]:+.2f}%" for n in texts)
        meets = "—" if r["budget_pct"] is None else ("yes" if r["meets"] else "no")
        saving = r.get("saving_pct")
        vs = "" if saving is None else (f"{saving:.1f}% fewer ({r['best_uniform']})" if saving >= 0
                                        else f"{-saving:.1f}% more ({r['best_uniform']})")
        if r["kind"] == "auto" and r.get("best_uniform") is None and r["budget_pct"] is not None:
            vs = "no uniform format meets it"
        speed = f" {r['tokens_per_s']:.0f} |" if meta.get("speed") else ""
        label = f"**auto** `{r['kv_format']}`" if r["kind"] == "auto" else f"`{r['kv_format']}`"
        lines.append(f"| {budget} | {label} | {r['bytes_per_token']:.0f} | {r['bits_per_element']:.2f} | {cells} | "
                     f"{meets} | {vs} |{speed}")
    lines += ["", "Per-layer choices (recipe `kv.layers`):", ""]
    for r in rows:
        if r["kind"] == "auto":
            steps = [c for c in r["checks"] if c["kind"] == "descent"]
            lines.append(f"- +{r['budget_pct']:g}%: from uniform `{r['start']}`, {sum(c['kept'] for c in steps)} of "
                         f"{len(steps)} descent checks kept, {r['search_wall_s']:.0f} s: `{json.dumps(r['layers'])}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, help="converted SmolLM2 (default: convert the builtin one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--budgets", default="0.5,1,3")
    ap.add_argument("--formats", default=",".join(DEFAULT_SEARCH_FORMATS))
    ap.add_argument("--num-samples", type=int, default=8, help="sensitivity windows (calibration data)")
    ap.add_argument("--validation-samples", type=int, default=4,
                    help="further calibration windows the uniform candidates and the descent's steps are checked "
                         "on (0: the sensitivity windows)")
    ap.add_argument("--margin", type=float, default=VALIDATION_MARGIN,
                    help="the fraction of the budget a choice must meet on the check windows")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--eval-tokens", type=int, default=8192)
    ap.add_argument("--ood", type=Path, default=None, help="out-of-domain .txt/.jsonl file or directory")
    ap.add_argument("--rotation", choices=("none", "hadamard"), default="none",
                    help="K/V rotated before they are stored (every candidate; docs/kv-rotation.md)")
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="score through the engine's default ops instead of its batch-invariant mode")
    ap.add_argument("--speed", action="store_true", help="also time greedy decode per configuration")
    ap.add_argument("--sensitivity-from", type=Path, default=None,
                    help="layer_precision.jsonl of an earlier run with the same model, formats and windows: "
                         "reuse its sensitivities")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=128)
    args = ap.parse_args()
    t0 = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="kvq-layer-precision-"))
    model_dir = args.model_dir
    if model_dir is None:
        from builder.convert import convert_source

        model_dir = work / "model"
        model_dir.mkdir()
        convert_source("smollm2-135m", None, model_dir, "float32")
    cfg = ModelConfig.from_dir(model_dir)
    candidates = [parse_kv_format_name(n) for n in args.formats.split(",")]
    rot = {}
    if args.rotation != "none":
        from runtime.rotation import KVRotation  # the kv.rotation feature

        rot = {"rotation": KVRotation(args.rotation, 0)}
    scales = {}
    if any(f.static for f in candidates):
        calib = work / "calib"
        calib.mkdir()
        run_calibration(model_dir, calib, num_samples=args.calib_samples, seq_len=args.calib_len, policy="max",
                        seed=0, device=args.device, **rot)
        scales = {f: scales_for(calib, f) for f in candidates if f.static}
    model = load_model(model_dir, device=args.device, **rot)
    tok = load_tokenizer(model_dir)
    drawn, _ = calibration_windows(model_dir, cfg, "builtin", args.num_samples + args.validation_samples,
                                   args.seq_len, 0)
    bi = not args.no_batch_invariant
    scorer = EngineScorer(model, model_dir, drawn[: args.num_samples], scales, batch_invariant=bi)
    validator = (EngineScorer(model, model_dir, drawn[args.num_samples:], scales, batch_invariant=bi)
                 if args.validation_samples else None)
    sensitivities: dict = {}  # options' names -> Sensitivity, shared by the budgets (same windows)
    if args.sensitivity_from:  # an earlier run's sensitivities (same model and windows): re-choose only
        meta = json.loads(args.sensitivity_from.read_text().splitlines()[0])["meta"]
        for d in meta["sensitivities"]:
            sens = Sensitivity.from_dict(d, parse_kv_format_name)
            sensitivities[tuple(f.name for f in sens.candidates)] = sens
    ood = args.ood or default_ood()
    texts = {"builtin": ("builtin", "the built-in corpus's evaluation split"), "out_of_domain": (str(ood), ood.name)}
    scorers = {n: EngineScorer(model, model_dir, eval_windows(tok, args.eval_tokens, 1024, src), scales,
                               batch_invariant=bi) for n, (src, _) in texts.items()}
    uniform = ladder(candidates, cfg)
    configs = {f.name: (f,) * cfg.num_layers for f in uniform}
    budgets = [float(b) for b in args.budgets.split(",")]
    found, search_s = {}, {}
    for b in budgets:
        t = time.perf_counter()
        found[b] = search(scorer, candidates, max_pct=b, validator=validator, margin=args.margin,
                          sensitivities=sensitivities)
        search_s[b] = round(time.perf_counter() - t, 1)
        configs[f"auto@{b:g}"] = found[b].formats
        print(f"+{b:g}%: {formats_name(found[b].formats)} ({search_s[b]:.0f} s; engine runs so far: "
              f"{scorer.passes + (validator.passes if validator else 0)})", flush=True)
    held = {n: heldout_change(s, configs) for n, s in scorers.items()}

    def meets(name: str, budget: float) -> bool:
        return all(held[t][name]["ppl_change_pct"] <= budget for t in texts)

    def row(kind: str, name: str, formats, budget: float | None) -> dict:
        r = {"kind": kind, "budget_pct": budget, "kv_format": formats_name(formats),
             "bytes_per_token": held["builtin"][name]["bytes_per_token"],
             "bits_per_element": bits_per_element(cfg, formats),
             "ppl_change_pct": {t: held[t][name]["ppl_change_pct"] for t in texts}}
        if budget is not None:
            r["meets"] = meets(name, budget)
        if args.speed:
            r["tokens_per_s"] = decode_speed(model, model_dir, formats, scales, args.concurrency, args.prompt_len,
                                             args.new_tokens)
        return r

    rows = [row("uniform", f.name, (f,) * cfg.num_layers, None) for f in uniform]
    for b in budgets:
        formats = found[b].formats
        r = row("auto", f"auto@{b:g}", formats, b)
        fitting = [u for u in rows[: len(uniform)] if meets(u["kv_format"], b)]
        best = min(fitting, key=lambda u: u["bytes_per_token"]) if fitting else None
        r.update(layers=layer_ranges(formats), best_uniform=best and best["kv_format"],
                 best_uniform_bytes_per_token=best and best["bytes_per_token"],
                 saving_pct=None if best is None else 100 * (1 - r["bytes_per_token"] / best["bytes_per_token"]),
                 start=found[b].start.name, search_wall_s=search_s[b],
                 checks=checks_to_json(found[b].checks, cfg))
        rows.append(r)
    meta = {"model": "SmolLM2-135M-Instruct" if args.model_dir is None else args.model_dir.name, "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or
            "cpu", "torch": torch.__version__, "python": sys.version.split()[0], "formats": [f.name for f in
            uniform], "num_samples": args.num_samples, "seq_len": args.seq_len,
            "engine_runs": scorer.passes + (validator.passes if validator else 0), "speed": args.speed,
            "batch_invariant": bi, "validation_samples": args.validation_samples, "margin": args.margin,
            "rotation": args.rotation,
            "texts": {n: {"source": d, "tokens": int(scorers[n].windows.numel())} for n, (_, d) in texts.items()},
            "sensitivities": [s.to_dict() for s in sensitivities.values()], "wall_s": round(time.perf_counter() - t0, 1)}
    if args.speed:
        meta.update(concurrency=args.concurrency, prompt_len=args.prompt_len, new_tokens=args.new_tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    with open(args.out / "layer_precision.jsonl", "w") as f:
        f.write(json.dumps({"meta": meta}) + "\n")
        for r in rows:
            f.write(json.dumps(r) + "\n")
    table = markdown(meta, rows)
    (args.out / "layer_precision.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
