"""Prefix caching on a multi-turn, shared-prefix workload: caching on vs off, per KV format.

    python3 -m benchmarks.prefix_cache --device cpu --out benchmarks/results          # SmolLM2, small
    python3 -m benchmarks.prefix_cache --device cuda --preset llama3-8b-synthetic \\
        --pool-gib 16 --out $OUT                                                        # H200

The workload (`Workload`, all in tokens, ids drawn from a seeded RNG):
  * a system prompt of `system_len` tokens that every request starts with;
  * `docs` documents of `doc_len` tokens; conversation i talks about document i % docs
    (RAG: the same document asked about by several users);
  * `conversations` chats of `turns` turns; turn t's prompt is the system prompt, the
    document, every earlier question and answer of that chat, then a new question of
    `question_len` tokens; the answer is `output_len` greedy tokens (ignore_eos);
  * a closed loop of `concurrency` clients: each sends its chat's next turn when the
    previous answer is complete, and starts the next chat when its chat is done.
So the prompt of a later turn is mostly tokens some earlier request already computed.

Per KV format and caching on/off, one engine with the same KV pool byte budget (`--pool-gib`
or `--pool-mib`; a more compressed format gets more pages, so it keeps more prefixes cached):
end-to-end output tokens/s (all generated tokens / wall time), TTFT p50/p99 (submit to first
token), the prefix cache's hit rate (full prompt pages found cached / looked up), reused
tokens, evictions, preemptions, and whether every answer equals the caching-off run's.
Rows go to OUT/prefix_cache.jsonl, a table to OUT/prefix_cache.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.kv_format import KVFormat
from runtime.kv_quant import static_scale_from_amax
from runtime.model import LlamaModel
from runtime.runner import plan_pool
from runtime.sampling import SamplingParams
from runtime.weights import open_weights

FORMATS = {
    "bf16": KVFormat("bf16"),
    "fp8_e4m3-per_tensor": KVFormat("fp8_e4m3", "per_tensor"),
    "int4-per_token-asym": KVFormat("int4", "per_token", symmetric=False),
}
MIB = 2**20


@dataclass(frozen=True)
class Workload:
    system_len: int = 64
    docs: int = 4
    doc_len: int = 96
    conversations: int = 8
    turns: int = 3
    question_len: int = 12
    output_len: int = 8
    concurrency: int = 4
    seed: int = 0


CPU_WORKLOAD = Workload(conversations=8, concurrency=3)
# About 148k distinct tokens, 16 chats of up to 8k tokens running: under a 24 GiB pool (what an 8B bf16
# model leaves for KV on a 40-48 GB GPU) BF16 must evict, FP8 and INT4 keep nearly everything cached.
GPU_WORKLOAD = Workload(system_len=1024, docs=16, doc_len=6144, conversations=64, turns=4, question_len=64,
                        output_len=128, concurrency=16)
GPU_POOL_GIB = 24.0


def _ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def run_workload(engine: Engine, w: Workload) -> dict:
    """Drive the closed loop; returns timings, stats and every answer (by chat and turn)."""
    rng = random.Random(w.seed)
    vocab = engine.cfg.vocab_size
    system = _ids(rng, w.system_len, vocab)
    docs = [_ids(rng, w.doc_len, vocab) for _ in range(w.docs)]
    questions = [[_ids(rng, w.question_len, vocab) for _ in range(w.turns)] for _ in range(w.conversations)]
    sp = SamplingParams(max_tokens=w.output_len, ignore_eos=True)
    answers: dict[tuple[int, int], list[int]] = {}
    ttfts: list[float] = []
    lock, all_done = threading.Lock(), threading.Event()
    next_chat = iter(range(w.conversations))
    state = {"active": 0}

    def send(chat: int, turn: int, history: list[int]) -> None:
        prompt = history + questions[chat][turn]
        out: list[int] = []
        t0 = time.perf_counter()

        def on_token(tok, finished, reason, *_):
            if tok is not None:
                if not out:
                    with lock:
                        ttfts.append(time.perf_counter() - t0)
                out.append(tok)
            if finished:
                answers[(chat, turn)] = out
                if turn + 1 < w.turns:
                    send(chat, turn + 1, prompt + out)
                else:
                    start_next()

        engine.submit(prompt, sp, on_token)

    def start_next() -> None:
        with lock:
            chat = next(next_chat, None)
            if chat is None:
                state["active"] -= 1
                if state["active"] == 0:
                    all_done.set()
                return
        send(chat, 0, system + docs[chat % w.docs])

    t0 = time.perf_counter()
    with lock:
        state["active"] = min(w.concurrency, w.conversations)
    for _ in range(state["active"]):
        start_next()
    all_done.wait()
    wall = time.perf_counter() - t0
    st = engine.stats
    q = statistics.quantiles(ttfts, n=100, method="inclusive")
    return {
        "wall_s": round(wall, 3), "requests": len(answers),
        "output_tokens_per_s": round(sum(map(len, answers.values())) / wall, 2),
        "ttft_p50_ms": round(1e3 * statistics.median(ttfts), 2), "ttft_p99_ms": round(1e3 * q[98], 2),
        "prefix_hit_rate": round(st.prefix_hit_rate, 4), "reused_tokens": st.reused_tokens,
        "evictions": st.evictions, "preemptions": st.preemptions, "prompt_tokens_sent": _prompt_tokens(w),
        "answers": answers,
    }


def _prompt_tokens(w: Workload) -> int:
    per_chat = sum(w.system_len + w.doc_len + (t + 1) * w.question_len + t * w.output_len for t in range(w.turns))
    return per_chat * w.conversations


def _static_scales(model: LlamaModel, fmt: KVFormat, sample: list[int]):
    """Max-policy per-layer scales from a dense pass over a workload-like sample (static formats)."""
    if not fmt.static:
        return None, None
    n = model.cfg.num_layers
    amax = {"k": torch.zeros(n), "v": torch.zeros(n)}

    def observe(i, k, v):
        amax["k"][i] = torch.maximum(amax["k"][i], k.abs().amax().float().cpu())
        amax["v"][i] = torch.maximum(amax["v"][i], v.abs().amax().float().cpu())

    with torch.no_grad():
        model.forward_dense(torch.tensor(sample, device=model.device), observer=observe)
    return static_scale_from_amax(amax["k"], fmt), static_scale_from_amax(amax["v"], fmt)


def load_model(args, root: Path) -> tuple[LlamaModel, str]:
    dev = torch.device(args.device)
    if args.preset.endswith("-synthetic"):
        from .headline import make_engine_dir

        d = make_engine_dir(root, "model", KVFormat("bf16"), 16, 1, 8192, args.preset.removesuffix("-synthetic"))
        dtype = torch.bfloat16
    else:
        from builder.convert import convert_source

        d = root / "model"
        d.mkdir()
        convert_source(args.preset, None, d, "float32")
        dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    cfg = ModelConfig.from_dir(d)
    return LlamaModel(cfg, open_weights(d, cfg), dev, dtype), args.preset


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--preset", default="smollm2-135m",
                   help="smollm2-135m (real weights) or <preset>-synthetic, e.g. llama3-8b-synthetic")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--pool-mib", type=float, default=None, help="KV pool budget, the same for every format")
    p.add_argument("--pool-gib", type=float, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-batch", type=int, default=None, help="default: the workload's concurrency")
    p.add_argument("--step-tokens", type=int, default=None, help="default: 2048 on the CPU, 8192 on CUDA")
    for f, default in asdict(CPU_WORKLOAD).items():
        p.add_argument(f"--{f.replace('_', '-')}", type=int, default=None, help=f"workload (CPU default {default})")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    base = CPU_WORKLOAD if args.device == "cpu" else GPU_WORKLOAD
    w = Workload(**{f: getattr(args, f) if getattr(args, f) is not None else v for f, v in asdict(base).items()})
    # CPU default: 600 tokens (37 pages) of SmolLM2 bf16 KV, against the CPU workload's 928
    # distinct tokens and up to 34 pages held by its 3 running chats: BF16 evicts shared
    # prefixes, FP8 (75 pages) and INT4 keep everything
    if args.pool_gib is None and args.pool_mib is None:
        args.pool_mib = 13.2 if args.device == "cpu" else GPU_POOL_GIB * 1024
    pool_bytes = int(args.pool_gib * 2**30 if args.pool_gib else args.pool_mib * MIB)
    step_tokens = args.step_tokens or (2048 if args.device == "cpu" else 8192)
    max_seq = w.system_len + w.doc_len + w.turns * (w.question_len + w.output_len)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model, model_name = load_model(args, Path(tmp))
        sample = _ids(random.Random(w.seed), min(1024, w.system_len + w.doc_len), model.cfg.vocab_size)
        for name in args.formats.split(","):
            fmt = FORMATS[name]
            scales = _static_scales(model, fmt, sample)
            plan = plan_pool(model.cfg, fmt, args.block_size, memory_budget=pool_bytes)
            by_mode = {}
            for caching in (False, True):
                eng = Engine(model, fmt, plan, *scales, max_batch_size=args.max_batch or w.concurrency,
                             max_tokens_per_step=step_tokens, max_seq_len=max_seq,
                             batch_invariant=model.device.type == "cpu", prefix_caching=caching)
                try:
                    by_mode[caching] = run_workload(eng, w)
                finally:
                    eng.shutdown()
            answers = {caching: r.pop("answers") for caching, r in by_mode.items()}
            for caching, r in by_mode.items():
                row = {"format": name, "prefix_caching": caching, **r,
                       "same_answers_as_caching_off": answers[caching] == answers[False],
                       "pool_budget_bytes": pool_bytes, "pool_bytes": plan.bytes, "pool_tokens": plan.tokens, "block_size": plan.block_size,
                       "model": model_name, "device": str(model.device),
                       "device_name": torch.cuda.get_device_name() if model.device.type == "cuda" else platform.processor() or platform.machine(),
                       "workload": asdict(w)}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "workload"}), flush=True)
    path = args.out / "prefix_cache.jsonl"
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    write_markdown(path, args.out / "prefix_cache.md")


TITLE = """# Prefix caching: multi-turn, shared-prefix workload

"answers = off": every request's greedy tokens equal the caching-off run's. On the CPU the engine runs in
batch-invariant mode, so a prompt's K/V are the same bits whichever step computed them, and the answers
are equal. On CUDA the engine runs without it (cuBLAS picks GEMM tiles by batch shape): a prefix computed
in another request's step differs in the last bits, and greedy decoding of random-weight models (tiny
logit margins) turns that into other tokens.
"""


def write_markdown(jsonl: Path, md: Path) -> None:
    """One table per (model, device, pool, workload) in `jsonl`, each with the latest row of every
    format and mode, so formats may be run by separate invocations."""
    groups: dict[str, dict] = {}
    for line in jsonl.read_text().splitlines():
        r = json.loads(line)
        key = json.dumps([r["model"], r["device"], r.get("pool_budget_bytes"), r["workload"]])
        groups.setdefault(key, {})[(r["format"], r["prefix_caching"])] = r
    tables = [render_table(list(same.values()), Workload(**json.loads(key)[3]), json.loads(key)[2])
              for key, same in groups.items()]
    tmp = md.with_suffix(".md.tmp")
    tmp.write_text("\n".join([TITLE, *tables]))
    tmp.replace(md)


def render_table(rows: list[dict], w: Workload, pool_bytes: int) -> str:
    r0 = rows[0]
    lines = [
        f"## {r0['model']} on {r0['device_name'] or r0['device']}, KV pool {pool_bytes / MIB:.1f} MiB", "",
        f"{r0['model']} on {r0['device']} ({r0['device_name'] or 'unknown'}), KV pool {pool_bytes / MIB:.1f} MiB "
        f"for every format, block size {r0['block_size']}. Workload: {json.dumps(asdict(w))} "
        f"({_prompt_tokens(w)} prompt tokens sent). `python3 -m benchmarks.prefix_cache`.", "",
        "| KV format | pool tokens | caching | out tok/s | TTFT p50 ms | TTFT p99 ms | hit rate | reused tok "
        "| evictions | preemptions | on/off tok/s | vs bf16 (same mode) | answers = off |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(r["format"], r["prefix_caching"]): r for r in rows}
    for r in rows:
        off = base[(r["format"], False)]["output_tokens_per_s"]
        bf = base.get(("bf16", r["prefix_caching"]))
        lines.append(
            f"| {r['format']} | {r['pool_tokens']} | {'on' if r['prefix_caching'] else 'off'} "
            f"| {r['output_tokens_per_s']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | {r['prefix_hit_rate']:.3f} "
            f"| {r['reused_tokens']} | {r['evictions']} | {r['preemptions']} | {r['output_tokens_per_s'] / off:.2f}x "
            f"| {r['output_tokens_per_s'] / bf['output_tokens_per_s']:.2f}x | {r['same_answers_as_caching_off']} |"
            if bf else "")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
