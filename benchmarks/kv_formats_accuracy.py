"""Separate K/V formats, group scales and scale dtypes on SmolLM2-135M, through the engine.

Every engine is scored by calibration.evaluate.run_evaluation (Engine.score: teacher-forced perplexity on the
built-in held-out split, greedy agreement, passkey), against unquantized KV, in one run on one machine. All the
formats here have dynamic (per-token) scales, so no calibration is needed. The scale-dtype rows decide the default
(`--set sweep`); the format rows are the accuracy table of docs/kv-formats.md (`--set formats`); `--set fp8`: the
FP8 default beside its candidates; `--set agreement`: the 8-bit-K formats whose top-1 agreement docs/kv-formats.md
reports.
Writes <out>/kv_formats_<set>.json and .md.

    python -m benchmarks.kv_formats_accuracy --set sweep --out benchmarks/results [--ppl-tokens 8192]
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from calibration.evaluate import EngineKV, EvalSettings, run_evaluation
from calibration.files import write_json_atomic, write_text_atomic
from calibration.report import markdown_table
from runtime.kv_format import KVFormat, format_from_name
from runtime.rotation import NO_ROTATION, KVRotation


def _int4(group: int = 0, scale: str = "float16", symmetric: bool = False) -> KVFormat:
    return KVFormat("int4", "per_token", symmetric, scale, group)


def _k8v4(scale: str = "float16", v_group: int = 0, k_dtype: str = "int8") -> KVFormat:
    return KVFormat(k_dtype, "per_token", True, scale, 0, "int4", False, v_group)


# the scale dtype (and group size) decision: INT4, where the scales' rounding matters most
SWEEP = [_int4(0, sd) for sd in ("float16", "bfloat16", "float32")] + [
    _int4(g, sd) for g in (32, 64) for sd in ("float16", "bfloat16", "float32")] + [
    _int4(32, sd, symmetric=True) for sd in ("float16", "e8m0")] + [
    KVFormat("int8", "per_token", True, sd, 32) for sd in ("float16", "e8m0")] + [
    KVFormat("fp8_e4m3", "per_token", True, sd, 32) for sd in ("float16", "e8m0")]
# the formats a user picks from
FORMATS = [KVFormat("int8", "per_token"), _k8v4(), _k8v4(k_dtype="fp8_e4m3"), _k8v4(v_group=64), _int4(),
           _int4(64), _int4(32)]
# the bundled 4-bit recipes' formats (recipes/bundled/smollm2-135m-{k8v4,int4}kv.yaml), rotated as they are
BUNDLED = [_k8v4(v_group=32), _int4(32)]
HADAMARD = KVRotation("hadamard", 0)
# all-INT4 at 4.5 bits: per-channel keys over each 64-token block (KIVI) beside per-token V, and the per-token
# INT4 it replaces, each unrotated and rotated
KIVI = [(f, r) for f in (format_from_name("k.int4-per_channel-asym+v.int4-per_token-asym"), _int4())
        for r in (NO_ROTATION, HADAMARD)]
FP8 = KVFormat("fp8_e4m3", "per_token")
# the FP8 default's candidates beside it (docs/kv-formats.md, FP8 section), each with its own rotation
FP8_SET = [(FP8, NO_ROTATION), (FP8, HADAMARD), (KVFormat("fp8_e4m3", "per_token", group_size=32), HADAMARD),
           (KVFormat("fp8_e4m3", "per_token", group_size=32), NO_ROTATION)]
# top-1 agreement of the 8-bit-K formats: K8V4 g32 and INT8 rotated as their recipes are, the FP8 default as is
AGREEMENT = [(_k8v4(v_group=32), HADAMARD), (KVFormat("int8", "per_token"), HADAMARD), (FP8, NO_ROTATION)]
SETS = {"sweep": SWEEP, "formats": FORMATS, "all": list(dict.fromkeys(SWEEP + FORMATS)), "bundled": BUNDLED,
        "kivi": KIVI, "fp8": FP8_SET, "agreement": AGREEMENT}
ROTATED = {"bundled": HADAMARD}  # sets of bare formats measured with K/V rotated (docs/kv-rotation.md)


def set_entries(name: str, rotations: str | None = None) -> list[tuple[KVFormat, KVRotation]]:
    """A set's (format, rotation) pairs: its own pairs, or its formats under the set's rotation; `rotations`
    ("none,hadamard") measures each of the set's formats under those instead."""
    rot = ROTATED.get(name, NO_ROTATION)
    entries = [e if isinstance(e, tuple) else (e, rot) for e in SETS[name]]
    if rotations is None:
        return entries
    chosen = [HADAMARD if r == "hadamard" else NO_ROTATION for r in rotations.split(",")]
    return [(f, r) for f in dict.fromkeys(f for f, _ in entries) for r in chosen]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", choices=sorted(SETS), default="formats")
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--model-dir", default=None, help="a converted SmolLM2 directory (default: convert the builtin)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--greedy-prompts", type=int, default=8)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--passkey-lengths", default="320,1024,3072")
    ap.add_argument("--passkey-trials", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma-separated format names: a subset")
    ap.add_argument("--ood", default=None, help="also the perplexity on this text (.txt/.jsonl or a directory)")
    ap.add_argument("--rotations", default=None, help="comma-separated none / hadamard: instead of the set's")
    args = ap.parse_args()
    t0 = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(args.model_dir) if args.model_dir else Path(tempfile.mkdtemp(prefix="kvq-fmt-")) / "model"
    if not args.model_dir:
        from builder.convert import convert_source  # benchmarks may use the builder

        model_dir.mkdir()
        convert_source("smollm2-135m", None, model_dir, "float32")
    entries = set_entries(args.set, args.rotations)
    if args.only:
        entries = [(f, r) for f, r in entries if f.name in args.only.split(",")]
    fmts = list(dict.fromkeys(f for f, _ in entries))
    specs = [EngineKV(f.name + (f"+{r.name}" if r.active else ""), f, rotation=r,
                      note=f"{f.bits_per_element(64):.3f} bits/element at head_dim 64") for f, r in entries]
    settings = EvalSettings(
        # the batch-invariant mode on the CPU only: on CUDA its prefill reads every token's context (docs/numerics.md)
        batch_invariant=args.device == "cpu",
        perplexity_tokens=args.ppl_tokens, perplexity_window=1024, greedy_prompts=args.greedy_prompts,
        greedy_tokens=args.greedy_tokens, passkey_lengths=[int(x) for x in args.passkey_lengths.split(",")],
        passkey_trials=args.passkey_trials, attention_tokens=256, engine_greedy=False,
        extra_eval_data=[args.ood] if args.ood else [])
    res = run_evaluation(model_dir, specs, None, settings, device=args.device, progress=True)
    res["bits_per_element"] = {f.name: f.bits_per_element(64) for f in fmts}
    res["host"] = {"machine": platform.machine(), "device": args.device, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "python": sys.version.split()[0],
                   "wall_s": round(time.perf_counter() - t0, 1)}
    write_json_atomic(out / f"kv_formats_{args.set}.json", res)
    table = markdown_table(res)
    bits = "\n".join(f"- {n}: {b:.3f} bits/element (head_dim 64, metadata included)"
                     for n, b in res["bits_per_element"].items())
    write_text_atomic(out / f"kv_formats_{args.set}.md",
                      f"# SmolLM2-135M: KV formats ({args.set}) vs unquantized KV\n\n{table}\n{bits}\n")
    print(table)


if __name__ == "__main__":
    main()
