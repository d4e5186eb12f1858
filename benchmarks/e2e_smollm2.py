"""End to end on the real SmolLM2: greedy output with the Triton kernels vs the reference path.

The kernels' end-to-end check. benchmarks/kernels.py's end_to_end() does the same
with synthetic weights; this script loads the real SmolLM2-135M-Instruct GGUF.
Run from the repository root on the GPU machine (needs torch, triton,
transformers, safetensors and the `gguf` wheel):

    python3 -m benchmarks.e2e_smollm2 --gguf PATH.gguf --out DIR
    python3 -m benchmarks.e2e_smollm2 --gguf-parts DIR_WITH_part-aa_part-ab_SHA256 --out DIR

The GGUF (98 MB) is larger than one transfer to the GPU machine, so it can
travel as `split -b` parts; --gguf-parts joins DIR/part-* in name order into a
temporary file and checks the whole against the sha256 in DIR/SHA256.

Steps: convert the GGUF with builder.convert (fp32 weights, GGUF tokenizer) into
a temporary directory; calibrate static scales with the calibration module
(policy max, built-in corpus); tokenize four prompts (37, 51, 94 and 321 tokens); then for
each KV format generate greedily (ignore_eos) with attention="reference" and
attention="triton" in bfloat16 and compare the token ids. At a divergence the
reference run's own top-1/top-2 logit margin at that position (logits read at
the engine's sampling step) and the logit gap to the token the kernels chose
are recorded, so a flip on a near-tie can be told from
a bug. One more row compares an fp32 reference (fp32 weights and KV) with
the bf16 Triton run. Rows go to DIR/kernels_e2e_smollm2.jsonl.

On the CPU (--device cpu) the Triton path runs under TRITON_INTERPRET=1: slow,
so keep it to e.g. --formats bf16,int8-tok --prompts 1 --max-tokens 4.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

from .gguf_parts import assemble_parts

DEFAULT_FORMATS = "bf16,fp8_e4m3,int8,int4,fp8_e4m3-tok,int8-tok,int4-tok-asym"
OUT_FILE = "kernels_e2e_smollm2.jsonl"
CALIBRATION = {"policy": "max", "dataset": "builtin", "num_samples": 8, "seq_len": 256, "seed": 0}

# Prompts, shortest first: two chat turns (rendered with the model's chat template)
# and two plain-text continuations of about 120 and 300 tokens.
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Explain in two sentences why the sky is blue, and then give one everyday example of the same effect.",
]
PROSE_MEDIUM = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, carrying a can of oil and a "
    "cloth for the lens. For thirty years he had watched the ships pass the rocks below, and he knew most "
    "of them by the shape of their hulls and the rhythm of their engines. On the night of the great storm, "
    "the lamp flickered twice and went out. He had only a few minutes before the fishing fleet would turn "
    "for the harbour, so he"
)
PROSE_LONG = (
    "A cache is a small, fast memory that keeps copies of data that a program is likely to need again soon. "
    "Processors have several levels of cache between the registers and main memory: the first level is tiny "
    "and answers in a few cycles, the last level is many megabytes and shared by all cores, and main memory "
    "is larger still but hundreds of cycles away. Programs run fast when the data they touch next is already "
    "close, which is why the order in which a loop walks through an array can change its speed tenfold. "
    "Large language models have a cache of their own. When a transformer generates text one token at a "
    "time, every new token attends to the keys and values of all the tokens before it. Recomputing those "
    "for the whole prefix at every step would cost a full forward pass per token, so inference engines keep "
    "them in a key-value cache that grows by one entry per layer and per token. For a long conversation "
    "this cache, not the weights, decides how many requests fit on one accelerator. Engineers therefore "
    "store the cached keys and values in fewer bits: eight-bit integers or floating point numbers halve the "
    "memory, four-bit integers quarter it. Each choice trades memory for a little accuracy, because a "
    "quantized key is only an approximation of the original, and attention scores computed from "
    "approximations can shift the probabilities of the next token. Whether that shift matters depends on "
    "the model, the length of the context and how the scales are chosen. The only reliable way to know is "
    "to measure it, comparing the tokens the model produces with and without the compressed cache, and"
)


def fail(msg: str) -> None:
    from runtime.errors import InputError

    raise InputError(msg)


# ------------------------------------------------------------- the model
def prompt_ids(tokenizer, count: int) -> tuple[list[list[int]], list[str]]:
    """Token ids of the first `count` prompts (chat ones through the chat template) and their text."""
    texts, ids = [], []
    for question in CHAT_PROMPTS:
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        texts.append(text)
        ids.append(tokenizer(text, add_special_tokens=False).input_ids)
    for text in (PROSE_MEDIUM, PROSE_LONG):
        texts.append(text)
        ids.append(tokenizer(text).input_ids)
    return ids[:count], texts[:count]


def static_scales(model_dir: Path, work: Path, device: str, formats) -> tuple[dict, dict | None]:
    """{format name: {"k_scale", "v_scale"}} from a calibrate run, when any format needs static scales."""
    from calibration.calibrate import run_calibration, scales_for

    static = [f for f in formats.values() if f.static]
    if not static:
        return {}, None
    calib = work / "calibration"
    calib.mkdir()
    t0 = time.perf_counter()
    run_calibration(model_dir, calib, device=device, dtype="bfloat16", **CALIBRATION)
    out = {}
    for fmt in static:
        k, v = scales_for(calib, fmt)
        out[fmt.name] = {"k_scale": k, "v_scale": v}
    print(f"calibrated static scales in {time.perf_counter() - t0:.1f} s ({CALIBRATION})", flush=True)
    return out, {**CALIBRATION, "module": "calibration.calibrate.run_calibration", "dtype": "bfloat16"}


def make_engine(model_dir: Path, prompts, device: str, dtype: str, fmt, scales, attention: str, max_tokens: int):
    from runtime.engine import Engine

    longest = max(len(p) for p in prompts) + max_tokens
    return Engine.from_dir(model_dir, device=device, dtype=dtype, kv_format=fmt, kv_scales=scales,
                           attention=attention, max_batch_size=len(prompts),
                           num_blocks=len(prompts) * (longest // 16 + 2), max_seq_len=longest + 16)


def generate(model_dir: Path, prompts, device: str, dtype: str, fmt, scales, attention: str, max_tokens: int,
             keep_logits: bool = False):
    """Greedy token ids of every prompt (one batch), the backend that ran, and (keep_logits) every step's
    (logits, sampled tokens)."""
    eng = make_engine(model_dir, prompts, device, dtype, fmt, scales, attention, max_tokens)
    try:
        with LogitTap(keep_logits) as tap:
            gens = eng.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
        return [g.token_ids for g in gens], eng.backend.name, tap.steps
    finally:
        eng.shutdown()


class LogitTap:
    """Records each engine step's logits and sampled tokens (wraps runtime.engine.sample).

    The engine has no logits API; its step loop hands every step's fp32 logits
    to `sample`, so wrapping that name reads them without touching the engine.
    """

    def __init__(self, active: bool):
        self.active, self.steps = active, []

    def __enter__(self):
        import runtime.engine

        self._mod, self._orig = runtime.engine, runtime.engine.sample
        if self.active:
            def tapped(logits, params, generators):
                tokens = self._orig(logits, params, generators)
                self.steps.append((logits.detach().to("cpu", torch.float32, copy=True), list(tokens)))
                return tokens

            runtime.engine.sample = tapped
        return self

    def __exit__(self, *exc):
        self._mod.sample = self._orig


class RoundedReference:
    """The reference decode attention with its probabilities rounded as the kernel rounds them.

    The kernel multiplies p by V on tensor cores, so p is rounded to fp16/bf16 first
    (runtime.kernels.plan.probability_dtype); the reference keeps fp32. A
    kernel that matches this reference where it misses the plain one differs by that
    rounding, not by a bug. (Per-token formats also scale p by s/max(s) before rounding;
    this emulation rounds p alone.)
    """

    def __enter__(self):
        import runtime.attention
        from runtime.kernels.plan import probability_dtype

        self._mod, self._orig = runtime.attention, runtime.attention.decode_attention
        orig = self._orig

        def rounded(q, cache, block_tables, seq_lens, sm_scale):
            return orig(q, cache, block_tables, seq_lens, sm_scale, p_dtype=probability_dtype(cache, q.dtype))

        runtime.attention.decode_attention = rounded
        return self

    def __exit__(self, *exc):
        self._mod.decode_attention = self._orig


def divergence_margins(steps, ref, tri, first_diff) -> list[dict]:
    """At each prompt's first divergence d: the reference run's own logits at step d.

    Rows of a step are the batch's sequences; with every prompt prefilled in the
    first step, row i of step s is prompt i's token s. That is checked against
    the recorded tokens, and margins are left out (with the reason) if it fails.
    """
    todo = [(i, d) for i, d in enumerate(first_diff) if d is not None]
    if not todo:
        return []
    n = len(ref)
    aligned = len(steps) == len(ref[0]) and all(
        len(toks) == n and toks == [ref[i][s] for i in range(n)] for s, (_, toks) in enumerate(steps))
    details = []
    for i, d in todo:
        item = {"prompt": i, "index": d, "ref_token": ref[i][d], "triton_token": tri[i][d]}
        if not aligned:
            item["margin_unavailable"] = "the reference steps' rows do not line up with the prompts"
        else:
            logits = steps[d][0][i]
            top = logits.topk(2)
            t = tri[i][d]
            item.update({
                "ref_margin_top1_top2": round(float(top.values[0] - top.values[1]), 4),
                "ref_gap_to_triton_token": round(float(top.values[0] - logits[t]), 4),
                "triton_token_rank_in_ref": int((logits > logits[t]).sum()),
            })
        details.append(item)
    return details


def compare(name, fmt, ref, tri, steps) -> dict:
    first_diff = [next((j for j, (a, b) in enumerate(zip(r, t)) if a != b), None) for r, t in zip(ref, tri)]
    return {"format": name, "fmt": fmt.name, "identical": ref == tri, "first_divergence": first_diff,
            "matching_prefix": [len(r) if d is None else d for r, d in zip(ref, first_diff)],
            "divergences": divergence_margins(steps, ref, tri, first_diff)}


def environment(device: str) -> dict:
    import torch
    import transformers
    import triton

    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    return {"device": device, "gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "interpret": os.environ.get("TRITON_INTERPRET") == "1",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def allow_interpreted_triton() -> None:
    """Let attention="triton" run on CPU tensors under TRITON_INTERPRET=1.

    runtime.attention.select_backend refuses "triton" off CUDA (right for users);
    this check-only run selects the kernels exactly as on CUDA instead.
    """
    import runtime.engine

    select = runtime.engine.select_backend

    def select_interpreted(device, fmt=None, prefer="auto"):
        return select("cuda" if prefer == "triton" else device, fmt, prefer)

    runtime.engine.select_backend = select_interpreted


# ------------------------------------------------------------------ main
def run(args) -> list[dict]:
    from builder.convert import convert_source
    from runtime.engine_dir import load_tokenizer

    from .kernels import FORMATS  # the format names shared by all kernel benchmarks

    names = [n for n in args.formats.split(",") if n]
    unknown = [n for n in names if n not in FORMATS]
    if unknown or not names:
        fail(f"unknown --formats {unknown or names}; choose from {', '.join(FORMATS)}.")
    formats = {n: FORMATS[n] for n in names}
    out = Path(args.out)
    env = environment(args.device)
    print(json.dumps(env), flush=True)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="e2e_smollm2.", dir=args.work) as tmp:
        work = Path(tmp)
        gguf = assemble_parts(Path(args.gguf_parts), work) if args.gguf_parts else Path(args.gguf)
        model_dir = work / "model"
        model_dir.mkdir()
        t0 = time.perf_counter()
        # fp32 weights: the fp32 reference row uses them as they are, bf16 engines cast at load.
        convert_source("gguf", gguf, model_dir, "fp32")
        print(f"converted {gguf.name} in {time.perf_counter() - t0:.1f} s", flush=True)
        tokenizer = load_tokenizer(model_dir)
        prompts, texts = prompt_ids(tokenizer, args.prompts)
        print(f"prompt lengths {[len(p) for p in prompts]}", flush=True)
        scales, calib = static_scales(model_dir, work, args.device, formats)
        common = {"kind": "e2e", "model": gguf.name, "dtype": "bfloat16", "max_tokens": args.max_tokens,
                  "prompt_lens": [len(p) for p in prompts], **env}
        bf16_triton = None
        for name, fmt in formats.items():
            t0 = time.perf_counter()
            sc = scales.get(fmt.name)
            ref, ref_backend, steps = generate(model_dir, prompts, args.device, "bfloat16", fmt, sc, "reference",
                                               args.max_tokens, keep_logits=True)
            tri, tri_backend, _ = generate(model_dir, prompts, args.device, "bfloat16", fmt, sc, "triton",
                                           args.max_tokens)
            with RoundedReference():
                rref, _, rsteps = generate(model_dir, prompts, args.device, "bfloat16", fmt, sc, "reference",
                                           args.max_tokens, keep_logits=True)
            rounded = {k: v for k, v in compare(name, fmt, rref, tri, rsteps).items() if k not in ("format", "fmt")}
            if name == "bf16":
                bf16_triton = (tri, tri_backend)
                print("bf16 reference, prompt 0:", repr(tokenizer.decode(ref[0])), flush=True)
            rows.append({**common, **compare(name, fmt, ref, tri, steps),
                         "reference_backend": ref_backend, "backend": tri_backend,
                         "kernels_used": tri_backend.startswith("triton"), "vs_reference_rounding_p": rounded,
                         "scales": calib if fmt.static else None, "seconds": round(time.perf_counter() - t0, 1),
                         "ref_tokens": ref, "triton_tokens": tri})
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_tokens")}), flush=True)
        if bf16_triton is not None and not args.skip_fp32:
            # Unquantized fp32 reference (fp32 weights, fp32 KV) vs the bf16 kernels' run above:
            # how far bf16 alone moves greedy output, the noise floor for the rows above.
            from runtime.kv_format import KVFormat

            t0 = time.perf_counter()
            fp32 = KVFormat("fp32")
            ref, ref_backend, steps = generate(model_dir, prompts, args.device, "float32", fp32, None, "reference",
                                               args.max_tokens, keep_logits=True)
            tri, tri_backend = bf16_triton
            rows.append({**common, **compare("fp32-ref-vs-bf16-triton", fp32, ref, tri, steps),
                         "dtype": "float32 reference / bfloat16 triton", "reference_backend": ref_backend,
                         "backend": tri_backend, "kernels_used": tri_backend.startswith("triton"), "scales": None,
                         "seconds": round(time.perf_counter() - t0, 1), "ref_tokens": ref, "triton_tokens": tri})
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("_tokens")}), flush=True)
        rows[0]["prompt_texts"] = texts
    out.mkdir(parents=True, exist_ok=True)  # only now: a failed run leaves nothing behind
    tmp_out = out / f".{OUT_FILE}.tmp"
    tmp_out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp_out, out / OUT_FILE)
    print(f"wrote {len(rows)} rows to {out / OUT_FILE}", flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--gguf", help="the SmolLM2 .gguf file")
    src.add_argument("--gguf-parts", help="directory with part-aa, part-ab, ... and SHA256 of the whole file")
    ap.add_argument("--out", required=True, help="directory for kernels_e2e_smollm2.jsonl")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--formats", default=DEFAULT_FORMATS, help="names from benchmarks/kernels.py FORMATS")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4, choices=range(1, 5), help="use the first N of the 4 prompts")
    ap.add_argument("--skip-fp32", action="store_true", help="skip the fp32-reference vs bf16-triton row")
    ap.add_argument("--work", default=None, help="where the temporary model directory goes (default: $TMPDIR)")
    args = ap.parse_args()
    if args.device == "cpu":
        # Must be set before runtime.kernels is imported; the kernels raise otherwise.
        os.environ["TRITON_INTERPRET"] = "1"
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    from runtime.errors import KvqError

    if args.device == "cpu":
        allow_interpreted_triton()
    elif not __import__("torch").cuda.is_available():
        print("error: --device cuda but torch sees no GPU; run on the GPU machine or pass --device cpu.")
        return 2
    try:
        run(args)
    except KvqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
