"""The README accuracy table for SmolLM2-135M: every KV dtype x granularity vs unquantized KV.

One run: convert the builtin SmolLM2 (or use --model-dir), calibrate on the
built-in corpus (64 x 512 tokens, `max` policy; `mse` rows for int4 derived
from the same statistics), run ModelOpt's FP8 KV calibration on the same token
windows, then evaluate every engine with calibration.evaluate.run_evaluation
(through the engine: Engine.score / generate). Beside each engine's numbers it
records the dense quantize/dequantize simulation's perplexity on the same
windows (same run) and the numbers of the previous table (--previous, the
simulation-run table this one replaces). Perplexity is also scored on
--extra-eval-data (default: the out-of-domain texts). The formats the bundled
recipes use are measured first, and every finished engine is saved to
<out>/accuracy_smollm2.partial.json / .md, so a long CPU run can be read early.
Writes <out>/accuracy_smollm2.json and .md (the table) and prints the table.

    python -m benchmarks.accuracy_table --out benchmarks/results [--device cuda] [--threads 1] [--only a,b]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import platform
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from calibration.calibrate import calibration_windows, run_calibration, scales_for
from calibration.evaluate import EngineKV, EvalSettings, run_evaluation
from calibration.files import write_json_atomic, write_text_atomic
from calibration.kvsim import DenseScorer, KVRoundTrip
from calibration.loading import load_model, load_tokenizer
from calibration.peer_modelopt import modelopt_fp8_scales, modelopt_kv_amax
from calibration.perplexity import eval_windows, perplexity
from calibration.report import markdown_table
from runtime.config import ModelConfig
from runtime.kv_format import KVFormat
from runtime.rotation import KVRotation

DTYPES = ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
GRANULARITIES = ("per_tensor", "per_head", "per_token")
HADAMARD = KVRotation("hadamard", 0)
SPLIT_AND_GROUP = (
    KVFormat("int8", "per_token", True, "float16", 0, "int4", False, 32),  # K8V4, V in groups of 32 channels
    KVFormat("int8", "per_token", True, "float16", 0, "int4", False, 0),  # K8V4
    KVFormat("int4", "per_token", False, "float16", 32),  # the bundled INT4 (5.0 bits/element)
    KVFormat("int4", "per_token", True, "float16", 32),  # 4.5 bits/element
    KVFormat("int4", "per_token", True, "float16", 32, "int4", False, 0),  # 4.5 bits/element, V asymmetric
    KVFormat("fp8_e4m3", "per_token", True, "float16", 0, "int4", False, 0),
    KVFormat("int4", "per_token", False, "float16", 64),
    KVFormat("int4", "per_token", True, "e8m0", 32),
)
# the formats the bundled recipes and docs lean on are measured first, so a run cut short still has them
FIRST = ("fp8_e4m3-per_token", "fp8_e4m3-per_token+hadamard-s0", "int8-per_token", "int8-per_token+hadamard-s0",
         "k.int8-per_token+v.int4-per_token-asym-g32+hadamard-s0", "k.int8-per_token+v.int4-per_token-asym+hadamard-s0",
         "int4-per_token-asym-g32+hadamard-s0",
         "int4-per_token-g32+hadamard-s0", "k.int4-per_token-g32+v.int4-per_token-asym+hadamard-s0",
         "int4-per_token-asym+hadamard-s0", "k.int8-per_token+v.int4-per_token-asym-g32",
         "k.int8-per_token+v.int4-per_token-asym")
OUT_OF_DOMAIN = str(Path(__file__).resolve().parents[1] / "calibration" / "data" / "out_of_domain")


def engines(calib: Path, mo_amax: tuple[torch.Tensor, torch.Tensor] | None) -> list[EngineKV]:
    out = []
    for d in DTYPES:
        for g in GRANULARITIES:
            f = KVFormat(d, g)
            k, v = scales_for(calib, f) if f.static else (None, None)
            out.append(EngineKV(f.name, f, k, v, "max policy" if f.static else "dynamic per-token scales"))
    # K/V rotated before they are stored (docs/kv-rotation.md): dynamic formats, which need no rotated calibration
    for f in (KVFormat("int4", "per_token", False), KVFormat("int8", "per_token"), KVFormat("fp8_e4m3", "per_token")):
        out.append(EngineKV(f"{f.name}+{HADAMARD.name}", f, note="dynamic per-token scales, Hadamard rotation",
                            rotation=HADAMARD))
    # K and V stored differently, and per-token group scales (docs/kv-formats.md), without and with the rotation
    for f in SPLIT_AND_GROUP:
        out.append(EngineKV(f.name, f, note="dynamic per-token scales"))
        out.append(EngineKV(f"{f.name}+{HADAMARD.name}", f, note="dynamic per-token scales, Hadamard rotation",
                            rotation=HADAMARD))
    for g in ("per_tensor", "per_head"):
        f = KVFormat("int4", g)
        k, v = scales_for(calib, f, policy="mse")
        out.append(EngineKV(f"{f.name}-mse", f, k, v, "mse policy"))
    if mo_amax is not None:
        f = KVFormat("fp8_e4m3", "per_tensor")
        for clamp in (False, True):
            k, v = modelopt_fp8_scales(*mo_amax, clamp=clamp)
            name = "modelopt-fp8-per_tensor" + ("-clamped" if clamp else "")
            note = "ModelOpt FP8_KV_CFG amax/448" + (", clamped to >= 1.0 as its TRT-LLM export does" if clamp else "")
            out.append(EngineKV(name, f, k, v, note))
    rank = {name: i for i, name in enumerate(FIRST)}
    return sorted(out, key=lambda e: rank.get(e.name, len(FIRST)))  # stable: the rest keep their order


def simulation_perplexity(model_dir: Path, specs: list[EngineKV], settings: EvalSettings, device: str) -> dict:
    """Perplexity change of the dense simulation (calibration.kvsim) on the evaluation's own windows."""
    model = load_model(model_dir, device=device)
    windows = eval_windows(load_tokenizer(model_dir), settings.perplexity_tokens, settings.perplexity_window,
                           settings.eval_data)
    base = perplexity(DenseScorer(model), windows)["perplexity"]
    out = {}
    rotated = {}  # a rotated engine's simulation runs the model with the same rotation folded in
    for e in specs:
        m = model
        if e.rotation.active:
            if e.rotation not in rotated:
                rotated[e.rotation] = load_model(model_dir, device=device, rotation=e.rotation)
            m = rotated[e.rotation]
        ppl = perplexity(DenseScorer(m, KVRoundTrip(e.fmt, m.cfg.num_layers, e.k_scale, e.v_scale)), windows)
        out[e.name] = {"perplexity": ppl["perplexity"], "change_pct": (ppl["perplexity"] / base - 1) * 100}
        print(f"simulation {e.name}: {out[e.name]['change_pct']:+.2f}%", flush=True)
    return {"baseline_perplexity": base, "engines": out}


def previous_numbers(path: Path) -> dict | None:
    """The headline numbers of an earlier table (its path, host and per-engine metrics)."""
    if not path.is_file():
        return None
    old = json.loads(path.read_text())
    keep = {name: {"change_pct": r["perplexity"]["change_pct"], "greedy": r["greedy"]["agreement"],
                   "passkey": f"{r['passkey']['found']}/{r['passkey']['trials']}"}
            for name, r in old.get("engines", {}).items() if "perplexity" in r}
    return {"path": old.get("path"), "host": old.get("host"), "settings": old.get("settings"),
            "baseline_perplexity": old["baseline"]["perplexity"]["perplexity"], "engines": keep}


def comparison_table(res: dict) -> str:
    """Engine-run numbers beside the simulation's (same run) and the previous table's."""
    sim = res.get("simulation", {}).get("engines", {})
    prev = (res.get("previous") or {}).get("engines", {})
    lines = ["| engine | Δ ppl engine | Δ ppl out-of-domain engine | Δ ppl simulation (same windows) | "
             "Δ ppl previous table | greedy engine | greedy previous | passkey engine | passkey previous |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in res["engines"].items():
        if "perplexity" not in r:
            continue
        s, p = sim.get(name), prev.get(name)
        ood = [x["change_pct"] for x in r.get("perplexity_extra", {}).values()]
        lines.append(" | ".join((
            f"| {name}", f"{r['perplexity']['change_pct']:+.2f}%", " / ".join(f"{x:+.2f}%" for x in ood) or "—",
            f"{s['change_pct']:+.2f}%" if s else "—", f"{p['change_pct']:+.2f}%" if p else "—",
            f"{r['greedy']['agreement']:.1%}", f"{p['greedy']:.1%}" if p else "—",
            f"{r['passkey']['found']}/{r['passkey']['trials']}", (p["passkey"] if p else "—") + " |")))
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--model-dir", default=None, help="a converted SmolLM2 directory (default: convert the builtin)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--ppl-tokens", type=int, default=8192)
    ap.add_argument("--greedy-prompts", type=int, default=8)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--passkey-lengths", default="320,1024,3072")
    ap.add_argument("--passkey-trials", type=int, default=20)
    ap.add_argument("--extra-eval-data", default=OUT_OF_DOMAIN,
                    help="more text scored for perplexity alone (default: the out-of-domain texts; '' for none)")
    ap.add_argument("--no-modelopt", action="store_true")
    ap.add_argument("--modelopt-amax", default=None,
                    help="JSON {k: [...], v: [...]} of ModelOpt amax measured elsewhere on the same windows "
                         "(e.g. on a machine without modelopt); --save-modelopt-amax writes one")
    ap.add_argument("--save-modelopt-amax", default=None)
    ap.add_argument("--modelopt-only", action="store_true", help="stop after ModelOpt calibration")
    ap.add_argument("--workers", type=int, default=1, help="evaluation processes (engines split between them)")
    ap.add_argument("--calib-samples", type=int, default=64)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--only", default=None, help="comma-separated engine names: a subset (e.g. to time a run)")
    ap.add_argument("--previous", default="benchmarks/results/accuracy_smollm2.json",
                    help="the earlier table to show beside this one (read before the new one is written)")
    ap.add_argument("--no-simulation", action="store_true", help="skip the dense simulation's perplexity")
    ap.add_argument("--no-batch-invariant", action="store_true",
                    help="run the engines without the batch-invariant mode (its cost or support on a GPU)")
    ap.add_argument("--attention", default="auto", choices=("auto", "reference"),
                    help="the engines' attention: auto (Triton kernels on CUDA) or the torch reference ops")
    args = ap.parse_args()
    previous = previous_numbers(Path(args.previous))
    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="kvq-acc-"))
    t0 = time.perf_counter()
    model_dir = Path(args.model_dir) if args.model_dir else work / "model"
    if not args.model_dir:
        from builder.convert import convert_source  # benchmarks may use the builder

        model_dir.mkdir()
        convert_source("smollm2-135m", None, model_dir, "float32")
    mo_amax = None
    if args.modelopt_amax:
        d = json.loads(Path(args.modelopt_amax).read_text())
        mo_amax = (torch.tensor(d["k"]), torch.tensor(d["v"]))
    elif not args.no_modelopt:
        from transformers import AutoModelForCausalLM

        windows, _ = calibration_windows(model_dir, ModelConfig.from_dir(model_dir), "builtin", args.calib_samples,
                                         args.calib_len, 0)
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        mo_amax = modelopt_kv_amax(hf, windows)
        del hf
        print("modelopt calibrated", flush=True)
        if args.save_modelopt_amax:
            write_json_atomic(Path(args.save_modelopt_amax), {"k": mo_amax[0].tolist(), "v": mo_amax[1].tolist(),
                                                              "samples": args.calib_samples, "seq_len": args.calib_len})
        if args.modelopt_only:
            return
    calib = work / "calib"
    calib.mkdir()
    cal = run_calibration(model_dir, calib, num_samples=args.calib_samples,
                          seq_len=args.calib_len, policy="max", seed=0, device=args.device)
    print(f"calibrated in {cal['seconds']} s", flush=True)
    settings = EvalSettings(
        perplexity_tokens=args.ppl_tokens, perplexity_window=1024, greedy_prompts=args.greedy_prompts,
        greedy_tokens=args.greedy_tokens, passkey_lengths=[int(x) for x in args.passkey_lengths.split(",")],
        passkey_trials=args.passkey_trials, attention_tokens=512, attention=args.attention,
        batch_invariant=not args.no_batch_invariant,
        extra_eval_data=[args.extra_eval_data] if args.extra_eval_data else [],
    )
    specs = engines(calib, mo_amax)
    if args.only:
        wanted = args.only.split(",")
        specs = [e for e in specs if e.name in wanted]
    def save(partial: dict) -> None:  # every finished engine is on disk: a long CPU run can be read while it runs
        write_json_atomic(out / "accuracy_smollm2.partial.json", partial)
        write_text_atomic(out / "accuracy_smollm2.partial.md", markdown_table(partial) + "\n" + comparison_table(partial))

    if args.workers <= 1:
        res = run_evaluation(model_dir, specs, None, settings, device=args.device, on_engine=save)
    else:  # each worker scores the baseline too; engines are dealt out round-robin
        groups = [specs[i :: args.workers] for i in range(args.workers)]
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=torch.set_num_threads,
                                 initargs=(max(1, args.threads),)) as ex:
            parts = list(ex.map(run_evaluation, [model_dir] * len(groups), groups, [None] * len(groups),
                                [settings] * len(groups), [None] * len(groups), [args.device] * len(groups)))
        res = parts[0]
        order = [e.name for e in specs]
        merged = {k: v for p in parts for k, v in p["engines"].items()}
        res["engines"] = {n: merged[n] for n in order}
        res["timing_s"] = {f"worker{i}": p["timing_s"] for i, p in enumerate(parts)}
    if not args.no_simulation:
        res["simulation"] = simulation_perplexity(model_dir, specs, settings, args.device)
    res["previous"] = previous
    res["calibration"] = {**cal, "report": json.loads((calib / "calibration.json").read_text())["timing_s"]}
    if mo_amax is not None:
        res["modelopt_amax"] = {"k": mo_amax[0].tolist(), "v": mo_amax[1].tolist()}
    res["host"] = {"machine": platform.machine(), "device": args.device, "torch": torch.__version__,
                   "threads": torch.get_num_threads(), "python": sys.version.split()[0],
                   "wall_s": round(time.perf_counter() - t0, 1)}
    write_json_atomic(out / "accuracy_smollm2.json", res)
    table = markdown_table(res) + "\n## Engine vs simulation\n\n" + comparison_table(res)
    write_text_atomic(out / "accuracy_smollm2.md", "# SmolLM2-135M: quantized KV vs unquantized KV\n\n" + table)
    print(table)


if __name__ == "__main__":
    main()
