"""KV rotation and FP8 robustness on SmolLM2-135M, measured through the engine.

Every KV format of interest with and without `kv.rotation: hadamard`, plus the FP8 candidates for the
bundled default (per_tensor with a calibrated margin, per_head, per_token), scored by
calibration.evaluate.run_evaluation (Engine.score / generate): perplexity on the built-in held-out
split and on an out-of-domain text (perplexity only), teacher-forced greedy agreement, passkey.
Calibration: the built-in corpus (stdlib docstrings), 64 x 512 tokens, `max` policy, once per
rotation (rotated engines get scales of the rotated K/V, as the pipeline calibrates them).

    python -m benchmarks.rotation_accuracy --out benchmarks/results [--ppl-tokens 8192] [--only a,b]

Writes <out>/rotation_accuracy.json and .md.
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

from calibration.calibrate import calibration_rotation, run_calibration, scales_for
from calibration.evaluate import EngineKV, EvalSettings, run_evaluation
from calibration.files import write_json_atomic, write_text_atomic
from calibration.report import markdown_table
from runtime.kv_format import KVFormat
from runtime.rotation import NO_ROTATION, KVRotation

HADAMARD = KVRotation("hadamard", 0)
# (name, format, scale margin): the formats the rotation is measured on, then the FP8 default's candidates
FORMATS = [
    ("int4-per_token-asym", KVFormat("int4", "per_token", False), 1.0),
    ("int8-per_token", KVFormat("int8", "per_token"), 1.0),
    ("fp8_e4m3-per_tensor", KVFormat("fp8_e4m3", "per_tensor"), 1.0),
    ("fp8_e5m2-per_tensor", KVFormat("fp8_e5m2", "per_tensor"), 1.0),
    ("int8-per_tensor", KVFormat("int8", "per_tensor"), 1.0),
]
FP8_CANDIDATES = [
    ("fp8_e4m3-per_tensor-margin2", KVFormat("fp8_e4m3", "per_tensor"), 2.0),
    ("fp8_e4m3-per_tensor-margin4", KVFormat("fp8_e4m3", "per_tensor"), 4.0),
    ("fp8_e4m3-per_head", KVFormat("fp8_e4m3", "per_head"), 1.0),
    ("fp8_e4m3-per_token", KVFormat("fp8_e4m3", "per_token"), 1.0),
]
MODULE = "python -m benchmarks.rotation_accuracy"
DEFAULT_OOD = Path(__file__).resolve().parents[1] / "calibration" / "data" / "out_of_domain"


def specs(calib: dict[KVRotation, Path], formats: list[tuple[str, KVFormat, float]]) -> list[EngineKV]:
    """Every engine for the calibrated rotations."""
    out = []
    for rot in calib:
        for name, fmt, margin in formats:
            k = v = None
            if fmt.static:
                k, v = (s * margin for s in scales_for(calib[rot], fmt))
            note = (f"max policy x {margin:g}" if margin != 1 else "max policy") if fmt.static else "per-token scales"
            label = name if not rot.active else f"{name}+{rot.name}"
            out.append(EngineKV(label, fmt, k, v, note, rotation=rot))
    return out


def summary_table(res: dict, ood: str) -> str:
    """One row per engine: both texts' perplexity change, greedy, passkey."""
    lines = ["| engine | Δ ppl held-out | Δ ppl out-of-domain | greedy (teacher-forced) | passkey | bits/element |",
             "|---|---|---|---|---|---|"]
    base = res["baseline"]["passkey"]
    lines.append(f"| baseline (fp32 KV) | — | — | 100% | {base['found']}/{base['trials']} | 32 |")
    for name, r in res["engines"].items():
        fmt = KVFormat(**r["kv_format"])
        bits = fmt.bytes_per_token_head(64) * 8 / 64  # SmolLM2's head_dim, metadata included
        o = r.get("perplexity_extra", {}).get(ood)
        lines.append(" | ".join((
            f"| {name}", f"{r['perplexity']['change_pct']:+.2f}%", f"{o['change_pct']:+.2f}%" if o else "—",
            f"{r['greedy']['agreement']:.1%}", f"{r['passkey']['found']}/{r['passkey']['trials']}",
            f"{bits:.2f} |")))
    return "\n".join(lines) + "\n"


def merge(paths: list[Path]) -> dict:
    """Results of runs over disjoint engine subsets (e.g. one process per rotation) as one: the baselines
    must agree (same model, windows and settings), the engines are pooled."""
    parts = [json.loads(p.read_text()) for p in paths]
    res = parts[0]
    for p, r in zip(paths[1:], parts[1:]):
        a, b = res["baseline"]["perplexity"]["perplexity"], r["baseline"]["perplexity"]["perplexity"]
        if abs(a / b - 1) > 1e-6 or r["settings"] != res["settings"]:
            raise SystemExit(f"{p}: another baseline or settings ({b} vs {a}); merge runs of one setup only.")
        res["engines"].update(r["engines"])
        res["calibration"].update(r["calibration"])
    res["merged_from"] = [str(p) for p in paths]
    res["commands"] = [r.get("command") for r in parts]
    res["hosts"] = [r.get("host") for r in parts]
    return res


def conditions(res: dict) -> str:
    """Where and how the numbers were measured, from the results themselves."""
    s = res["settings"]
    hosts = res.get("hosts") or [res.get("host")]
    # runs that recorded sys.argv whole name the script by its path
    cmds = [c if not c or c.startswith(MODULE) else MODULE + " " + c.split(" ", 1)[1]
            for c in res.get("commands") or [res.get("command")]]
    cal = ", ".join(f"{k}: {'reused ' + v['reused'] if 'reused' in v else str(v.get('seconds')) + ' s'}"
                    for k, v in res.get("calibration", {}).items())
    lines = [
        f"Perplexity: {s['perplexity_tokens']} tokens in windows of {s['perplexity_window']} of the built-in held-out "
        f"split and of `{Path(res['out_of_domain_text']).name}` (out of domain); greedy: {s['greedy_prompts']} prompts "
        f"x {s['greedy_tokens']} tokens, teacher-forced on the baseline's; passkey: {s['passkey_trials']} trials at "
        f"each of {s['passkey_lengths']} tokens. Calibration: built-in corpus, max policy, once per rotation ({cal}).",
        "Hosts: " + "; ".join(f"{h['device']} ({h['machine']}), torch {h['torch']}, {h['threads']} thread(s), "
                                f"Python {h['python']}, {h['wall_s']} s" for h in hosts if h) + ".",
        "", "Commands:", "", *(f"    {c}" for c in cmds if c), ""]
    return "\n".join(lines)


def write_outputs(res: dict, out: Path, stem: str) -> str:
    ood = res["out_of_domain_text"]
    table = summary_table(res, ood)
    write_json_atomic(out / f"{stem}.json", res)
    write_text_atomic(out / f"{stem}.md", "# SmolLM2-135M: KV rotation and FP8 robustness, through the engine\n\n"
                      + conditions(res) + "\n" + table + "\n## Every metric (held-out text)\n\n" + markdown_table(res))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--model-dir", default=None, help="a converted SmolLM2 directory (default: convert the builtin)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ood", default=str(DEFAULT_OOD), help="out-of-domain text (.txt/.jsonl or a directory)")
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--greedy-prompts", type=int, default=8)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--passkey-lengths", default="320,1024,3072")
    ap.add_argument("--passkey-trials", type=int, default=20)
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--only", default=None, help="comma-separated engine names (a subset)")
    ap.add_argument("--formats", default=None,
                    help="comma-separated KV format names (runtime.engine_dir.parse_kv_format_name) measured with "
                         "and without the rotation, instead of the built-in list")
    ap.add_argument("--no-engine-greedy", action="store_true", help="skip free-running generation (time)")
    ap.add_argument("--tag", default="", help="suffix of the result files' names")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--attention-tokens", type=int, default=512)
    ap.add_argument("--calibrated", nargs="*", default=[], metavar="DIR",
                    help="calibration directories to reuse (their calibration.json names the rotation), e.g. "
                         "an earlier run's calib-none and calib-hadamard-s0")
    ap.add_argument("--merge", nargs="+", type=Path, default=None,
                    help="only write <out>/rotation_accuracy[_TAG].json/.md from these runs' JSON files")
    args = ap.parse_args()
    stem = "rotation_accuracy" + (f"_{args.tag}" if args.tag else "")
    if args.merge:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        print(write_outputs(merge(args.merge), Path(args.out), stem))
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvq-rot-"))
    model_dir = Path(args.model_dir) if args.model_dir else work / "model"
    if not args.model_dir:
        from builder.convert import convert_source  # benchmarks may use the builder

        model_dir.mkdir()
        convert_source("smollm2-135m", None, model_dir, "float32")
    wanted = args.only.split(",") if args.only else None
    rotations = [NO_ROTATION, HADAMARD]
    if wanted is not None:  # calibrate only for the rotations the subset uses
        rotations = [r for r in rotations if any(n.endswith(f"+{HADAMARD.name}") == r.active for n in wanted)]
    formats = FORMATS + FP8_CANDIDATES
    if args.formats:
        from runtime.engine_dir import parse_kv_format_name

        formats = [(n, parse_kv_format_name(n), 1.0) for n in args.formats.split(",")]
    calib, cal_facts = {}, {}
    reuse = {calibration_rotation(d): Path(d) for d in args.calibrated}
    for rot in rotations:
        if rot.name in reuse:
            calib[rot] = reuse[rot.name]
            cal_facts[rot.name] = {"reused": str(reuse[rot.name]),
                                   **json.loads((reuse[rot.name] / "calibration.json").read_text())["timing_s"]}
            continue
        calib[rot] = work / f"calib-{rot.name}"
        calib[rot].mkdir()
        cal_facts[rot.name] = run_calibration(model_dir, calib[rot], num_samples=args.calib_samples,
                                              seq_len=args.calib_len, policy="max", seed=0, device=args.device,
                                              rotation=rot)
        print(f"calibrated ({rot.name}) in {cal_facts[rot.name]['seconds']} s", flush=True)
    engines = [e for e in specs(calib, formats) if wanted is None or e.name in wanted]
    settings = EvalSettings(
        # the batch-invariant mode on the CPU only: on CUDA its prefill reads every token's context (docs/numerics.md)
        batch_invariant=args.device == "cpu",
        perplexity_tokens=args.ppl_tokens, perplexity_window=1024, greedy_prompts=args.greedy_prompts,
        greedy_tokens=args.greedy_tokens, passkey_lengths=[int(x) for x in args.passkey_lengths.split(",")],
        passkey_trials=args.passkey_trials, attention_tokens=args.attention_tokens, engine_greedy=not args.no_engine_greedy,
        extra_eval_data=[args.ood],
    )
    res = run_evaluation(model_dir, engines, None, settings, device=args.device, progress=True)
    res["out_of_domain_text"] = args.ood
    res["command"] = " ".join([MODULE, *sys.argv[1:]])
    res["calibration"] = cal_facts
    res["host"] = {"machine": platform.machine(), "device": args.device, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "python": sys.version.split()[0],
                   "wall_s": round(time.perf_counter() - t0, 1)}
    print(write_outputs(res, out, stem))
    print(json.dumps(res["timing_s"]))


if __name__ == "__main__":
    main()
