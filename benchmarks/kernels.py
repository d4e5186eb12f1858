"""GPU benchmark of the KV kernels against cuDNN SDPA on dense BF16 KV.

Run on the GPU machine from the repository root (needs only torch and triton):

    python -m benchmarks.kernels --out benchmarks/results            # full grid
    python -m benchmarks.kernels --quick --out /tmp/r                 # one shape
    python -m benchmarks.kernels --models llama3-8b --shapes 16x32768,1x131072 --out /tmp/r   # part of it

For each model shape x (batch, context) x KV format it records the decode
kernel's median GPU time under its default plan (runtime.kernels.decode_plan; the plan's fields go into the row) (CUDA-graph replays, L2 emptied before each call by
reading 256 MiB -- `--flush write` zeroes them instead, as runs before 2026-11-30
did, which charges every call the write-back of those dirty lines: gpu_timing.py;
the eager launch time beside it), the GB/s of KV it actually reads (pages of the valid
tokens plus per-token scales/zeros), its speedup over torch SDPA with the
cuDNN backend on dense BF16 KV of the same shape measured in the same run, and
its error against an fp32 attention over the dequantized cache. The write
kernel's GB/s (bf16 K/V read + cache bytes written) is recorded per format,
and the machine's copy and read bandwidth are measured first as ceilings.
Rows go to kernels.jsonl (one JSON object per line), a table to kernels.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import (
    DEFAULT_FLUSH,
    FLUSH_MODES,
    ceilings,
    eager_ms,
    env_line,
    gpu_env,
    median_ms,
    read_gbps,
)
from runtime import attention, channel_keys
from runtime.kernels import DecodePlan, decode_attention, decode_plan, decode_plan_for, write_kv
from runtime.kv_cache import allocate_layer
from runtime.kv_format import PER_CHANNEL_TOKENS, KVFormat, format_from_name
from runtime.kv_quant import dequantize

FORMATS = {
    "bf16": KVFormat("bf16"),
    "fp8_e4m3": KVFormat("fp8_e4m3", "per_tensor"),
    "fp8_e4m3-tok": KVFormat("fp8_e4m3", "per_token"),
    "int8": KVFormat("int8", "per_tensor"),
    "int8-tok": KVFormat("int8", "per_token"),
    "int8-tok-asym": KVFormat("int8", "per_token", symmetric=False),
    "int4": KVFormat("int4", "per_head"),
    "int4-tok": KVFormat("int4", "per_token"),
    "int4-tok-asym": KVFormat("int4", "per_token", symmetric=False),
    # K and V of their own formats, group scales (docs/kv-formats.md): the mixed-format kernels
    "k8v4": KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False),
    "k8v4-g32": KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False, v_group_size=32),
    "kfp8v4": KVFormat("fp8_e4m3", "per_token", v_dtype="int4", v_symmetric=False),
    "int4-g64-asym": KVFormat("int4", "per_token", symmetric=False, group_size=64),
    "int4-g32-asym": KVFormat("int4", "per_token", symmetric=False, group_size=32),
    # per-channel keys (KIVI) over blocks of 64 positions: decode_channel_keys.py, write_channel_keys.py
    "kivi": format_from_name("k.int4-per_channel-asym+v.int4-per_token-asym"),
}


def format_of(name: str) -> KVFormat:
    """The format of a --formats entry: FORMAT, or FORMAT@KERNEL (that kernel family's plan, `plan_of`)."""
    return FORMATS[name.split("@")[0]]


def plan_of(name: str, case, cache) -> DecodePlan:
    """The default plan of the case, or for FORMAT@KERNEL that family's ("gluon" or "triton", `decode_plan`'s
    kernel=; for the mixed formats "triton" is decode_mixed.py): the kernels side by side in one run."""
    if "@" not in name:
        return decode_plan_for(case.q, cache, case.block_tables)
    return decode_plan(cache.fmt, case.batch, case.heads, case.kv_heads, case.block_tables.shape[1] * BLOCK_SIZE,
                       case.q.device, head_dim=case.head_dim, block_size=BLOCK_SIZE, q_dtype=case.q.dtype,
                       kernel=name.split("@")[1])


def ideal_ratio(fmt: KVFormat, head_dim: int) -> float:
    """BF16 bytes / the format's bytes (metadata included): the decode speedup over BF16 a purely bandwidth-bound
    kernel would reach (K8V4 ~2.6x, INT4 group-64 ~3.55x at head_dim 128)."""
    return 16 / fmt.bits_per_element(head_dim)
# (query heads, KV heads, head_dim): Llama-3-8B, and Llama-3-70B with TP=8 (one KV head per GPU)
MODELS = {"llama3-8b": (32, 8, 128), "llama3-70b-tp8": (8, 1, 128)}
# ... and, outside the grid, for side-by-side runs: the llama70b recipes' TP 2 (4 KV heads a GPU)
GEOMETRIES = {**MODELS, "llama3-70b-tp2": (32, 4, 128)}
# 32 x 32768: int4 reads as many bytes as 8-bit at 16 x 32768; 64 x 32768: int4 reads the read ceiling's own 2 GiB
GRID = [(1, 131072), (16, 32768), (32, 32768), (64, 32768), (64, 8192), (128, 4096)]
BLOCK_SIZE = 16
DEVICE = "cuda"
FLUSH = DEFAULT_FLUSH  # how median_ms empties L2 before a timed call (gpu_timing.FLUSH_MODES)
CHECK_SHAPE = ("llama3-8b", 16, 32768)  # where each format's output is also checked against the fp32 reference


class Case:
    """One model shape x (batch, context): inputs, block tables, dense BF16 SDPA baseline."""

    def __init__(self, model: str, batch: int, ctx: int, seed: int = 0, block_size: int = BLOCK_SIZE):
        self.model, self.batch, self.ctx, self.block_size = model, batch, ctx, block_size
        self.heads, self.kv_heads, self.head_dim = GEOMETRIES[model]
        g = torch.Generator(device=DEVICE).manual_seed(seed)
        tokens = batch * ctx
        self.k = torch.randn(tokens, self.kv_heads, self.head_dim, device=DEVICE, generator=g, dtype=torch.bfloat16)
        self.v = torch.randn(tokens, self.kv_heads, self.head_dim, device=DEVICE, generator=g, dtype=torch.bfloat16)
        self.k[:, :, 3] += 3.0  # an outlier channel
        self.q = torch.randn(batch, self.heads, self.head_dim, device=DEVICE, generator=g, dtype=torch.bfloat16)
        pages = -(-ctx // block_size)
        self.num_blocks = batch * pages
        perm = torch.randperm(self.num_blocks, device=DEVICE, generator=g)
        self.block_tables = perm.view(batch, pages).to(torch.int32)
        t = torch.arange(ctx, device=DEVICE)
        self.slots = (self.block_tables[:, t // block_size].long() * block_size + t % block_size).flatten()
        self.seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
        self.sm_scale = 1.0 / math.sqrt(self.head_dim)

    def sdpa_ms(self) -> tuple[float, str]:
        """cuDNN SDPA on dense [B, kv_heads, L, D] BF16; the group's query heads are its query rows."""
        from torch.nn.attention import SDPBackend, sdpa_kernel

        b, kvh, d = self.batch, self.kv_heads, self.head_dim
        kd = self.k.view(b, self.ctx, kvh, d).transpose(1, 2).contiguous()
        vd = self.v.view(b, self.ctx, kvh, d).transpose(1, 2).contiguous()
        q4 = self.q.view(b, kvh, self.heads // kvh, d)
        for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
            try:
                with sdpa_kernel([backend]):
                    fn = lambda: F.scaled_dot_product_attention(q4, kd, vd, scale=self.sm_scale)  # noqa: E731
                    fn()
                    ms = median_ms(fn, flush=FLUSH)
                return ms, backend.name
            except RuntimeError as e:  # backend refuses this shape: try the next, say which ran
                print(f"  {backend.name} unavailable: {str(e)[:120]}", flush=True)
        return float("nan"), "none"

    def cache(self, fmt: KVFormat):
        ks = vs = None
        if fmt.static:
            kam = self.k.float().abs().amax((0, 2))
            vam = self.v.float().abs().amax((0, 2))
            if fmt.granularity == "per_tensor":
                kam, vam = kam.max(), vam.max()
            ks, vs = (kam / fmt.qmax).float(), (vam / fmt.qmax).float()
        return allocate_layer(fmt, self.num_blocks, self.block_size, self.kv_heads, self.head_dim, DEVICE, ks, vs,
                              residual_slots=self.batch if fmt.per_channel_keys else 0)

    def fill(self, cache) -> None:
        """Write every sequence's K/V into the cache. Per-channel keys through the reference write as an engine's
        steps do (each prompt but its last token, then the last tokens in one decode write), so each sequence's own
        block holds its fp16 residual."""
        if not cache.fmt.per_channel_keys:
            write_kv(cache, self.k, self.v, self.slots)
            return
        last = torch.arange(self.batch, device=DEVICE) * self.ctx + self.ctx - 1
        body = torch.ones(self.batch * self.ctx, dtype=torch.bool, device=DEVICE)
        body[last] = False
        attention.write_kv(cache, self.k[body], self.v[body], self.slots[body])
        attention.write_kv(cache, self.k[last], self.v[last], self.slots[last])

    def kv_bytes(self, fmt: KVFormat) -> int:
        """Bytes the decode kernel must read: K and V of every valid token, scales included."""
        return int(2 * self.batch * self.ctx * self.kv_heads * fmt.bytes_per_token_head(self.head_dim))

    def write_bytes(self, fmt: KVFormat) -> int:
        """Bytes the write kernel moves: the step's K and V read, the cache's bytes written."""
        return 2 * self.k.numel() * self.k.element_size() + self.kv_bytes(fmt)

    def reference(self, cache) -> torch.Tensor:
        """fp32 attention over the dequantized cache, in sequence order."""
        b, kvh, d = self.batch, self.kv_heads, self.head_dim
        if cache.fmt.per_channel_keys:  # the reference ops' position rule, in fp32
            return channel_keys.decode_attention(self.q.float(), cache, self.block_tables, self.seq_lens,
                                                 self.sm_scale, attention._sdpa)
        bt = self.block_tables.long()

        def deq(name):
            fmt = cache.fmt.side(name)
            x = getattr(cache, name)[bt]  # [B, pages, kvh, bs, Ds]
            s, z = getattr(cache, f"{name}_scale"), getattr(cache, f"{name}_zero")
            if fmt.dynamic:
                s = s[bt]  # [B, pages, kvh, bs (, groups)]
                z = z[bt] if z is not None else None
            else:
                s = s.view(1, 1, -1, 1) if s is not None and s.dim() else s
            y = dequantize(x, fmt, s, z)  # [B, pages, kvh, bs, D]
            return y.permute(0, 2, 1, 3, 4).reshape(b, kvh, self.ctx, d)

        k, v = deq("k"), deq("v")
        q4 = self.q.float().view(b, kvh, -1, d)
        p = torch.softmax(q4 @ k.transpose(-1, -2) * self.sm_scale, -1)
        return (p @ v).view(b, self.heads, d)


def run_case(case: Case, fmt_names, rows, sink, check: bool, plan_changes: dict | None = None):
    """Each format's write and decode (under its default plan, with `plan_changes` if given) at this case."""
    sdpa_ms, backend = case.sdpa_ms()
    dense = case.kv_bytes(KVFormat("bf16"))
    print(f"{case.model} {case.batch}x{case.ctx}: SDPA[{backend}] {sdpa_ms:.3f} ms "
          f"({dense / sdpa_ms / 1e6:.0f} GB/s)", flush=True)
    base, paged = case, None
    for name in fmt_names:
        fmt = format_of(name)
        case = base
        if fmt.per_channel_keys:  # blocks of 64 positions; the same q, K and V (the same seed)
            paged = paged or Case(base.model, base.batch, base.ctx, block_size=PER_CHANNEL_TOKENS)
            case = paged
        cache = case.cache(fmt)
        case.fill(cache)
        # per-channel keys: the whole cache in one write quantizes whole blocks and rewrites the own blocks'
        # residual rows with the values fill left there, so every timed call writes the same bytes
        write_ms = median_ms(partial(write_kv, cache, case.k, case.v, case.slots), flush=FLUSH)
        write_bytes = case.write_bytes(fmt)
        plan = dataclasses.replace(plan_of(name, case, cache), **(plan_changes or {}))
        launch = partial(decode_attention, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale, plan=plan)
        ms = median_ms(launch, flush=FLUSH)
        eager = eager_ms(launch)
        err = None
        if check:
            ref = case.reference(cache)
            err = ((launch().float() - ref).norm() / ref.norm()).item()
        kvb = case.kv_bytes(fmt)
        row = {
            "kind": "decode", "model": case.model, "batch": case.batch, "ctx": case.ctx, "format": name,
            "fmt": fmt.name, "ms": ms, "kv_bytes": kvb, "gbps": kvb / ms / 1e6, "read_gbps_same_size": read_gbps(kvb, FLUSH),
            "sdpa_ms": sdpa_ms, "sdpa_backend": backend, "speedup": sdpa_ms / ms, "eager_ms": eager,
            "ideal": ideal_ratio(fmt, case.head_dim), "bits_per_element": fmt.bits_per_element(case.head_dim),
            "timing": f"cuda graph, L2 flushed per call ({FLUSH})",
            "write_ms": write_ms, "write_gbps": write_ms and write_bytes / write_ms / 1e6, "relerr_vs_fp32": err,
            "kernel": plan.kernel, "plan": dataclasses.asdict(plan),
            "heads": case.heads, "kv_heads": case.kv_heads, "head_dim": case.head_dim, "block_size": case.block_size,
        }
        rows.append(row)
        sink.write(json.dumps(row) + "\n")
        sink.flush()
        print(f"  {name:14s} {ms:.4f} ms {row['gbps']:6.0f} GB/s x{row['speedup']:.2f} (ideal x{row['ideal']:.2f}) "
              f"write {row['write_gbps'] or 0:5.0f} GB/s {plan_text(plan)} err={err}", flush=True)
        del cache


def plan_text(plan) -> str:
    """The plan's fields that matter for its kernel, short."""
    if plan.kernel in ("gluon", "channel_keys_gluon"):
        return (f"{plan.kernel} splits={plan.splits} regs={plan.registers} stages={plan.stages}"
                f"{' pairs' if plan.pairs else ''}{' tma' if plan.tma else ''} kc={plan.k_chains}")
    return (f"{plan.kernel} splits={plan.splits} n={plan.block_n} warps={plan.num_warps} stages={plan.num_stages}"
            f" regs={plan.registers}")


def end_to_end(out: Path, device: str = "cuda", preset_name: str = "smollm2-135m", max_tokens: int = 32) -> list[dict]:
    """Greedy generation through runtime.Engine with the kernels vs the reference path.

    The SmolLM2 GGUF (93 MB) is larger than what travels to the GPU machine, so this uses
    SmolLM2's geometry (9 heads, 3 KV heads, head_dim 64, 30 layers) with the engine's
    seeded synthetic weights; prompts are token ids.
    """
    import tempfile

    from runtime.config import preset
    from runtime.engine import Engine

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        (d / "config.json").write_text(json.dumps(preset(preset_name).to_hf_dict("bfloat16")))
        (d / "synthetic.json").write_text(json.dumps({"seed": 0}))
        g = torch.Generator().manual_seed(0)
        vocab = preset(preset_name).vocab_size
        prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 40, 133, 301)]
        formats = [None, KVFormat("int8", "per_token"), KVFormat("int4", "per_token", symmetric=False),
                   KVFormat("fp8_e4m3", "per_token"), KVFormat("int4", "per_token"), FORMATS["k8v4"],
                   FORMATS["int4-g64-asym"]]
        for fmt in formats:
            tokens = {}
            for attention in ("reference", "triton"):
                eng = Engine.from_dir(d, device=device, dtype="bfloat16", kv_format=fmt, attention=attention,
                                      max_batch_size=8, num_blocks=512, max_seq_len=512)
                gens = eng.generate(prompts, max_tokens=max_tokens, ignore_eos=True)
                tokens[attention] = ([g.token_ids for g in gens], eng.backend.name)
                eng.shutdown()
            ref, tri = tokens["reference"][0], tokens["triton"][0]
            first_diff = [next((i for i, (a, b) in enumerate(zip(r, t)) if a != b), None) for r, t in zip(ref, tri)]
            row = {"kind": "e2e", "model": f"synthetic:{preset_name}", "format": fmt.name if fmt else "bf16",
                   "backend": tokens["triton"][1], "identical": ref == tri, "first_divergence": first_diff,
                   "prompt_lens": [len(p) for p in prompts], "max_tokens": max_tokens}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(out / "kernels_e2e.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows


def markdown(env: dict, rows: list[dict]) -> str:
    lines = [
        "# Decode-attention kernel benchmark",
        "",
        env_line(env),
        f"Ceilings measured in the same run: copy {env['copy_gbps']:.0f} GB/s (read+write), "
        f"read-only reduction {env['read_gbps']:.0f} GB/s over 2 GiB; '% same-size read' is against the same "
        "reduction over the row's own KV bytes (a read of < 1 GB pays its fixed costs too).",
        f"Page size {BLOCK_SIZE}, pages in random order, all sequences full length, q/out bf16. "
        "GB/s = KV bytes actually read (values + per-token scales) / median time. Times are GPU times "
        f"from CUDA-graph replays with L2 emptied before each call (by a {env.get('flush', 'write')} of 256 MiB); "
        "'eager ms' times the launcher's "
        "eager calls (host time included where it outlasts the kernel). "
        "Baseline: torch SDPA (cuDNN backend) on dense BF16 KV of the same shape, same run.",
        "",
        "Plan: the default DecodePlan's kernel (gluon = decode_gluon.py, one-warp programs of 16-token tiles; "
        "warps = decode_warps.py; tiles = decode_tiles.py) and its main fields (docs/interfaces.md).",
        "",
        "Ideal = BF16 bytes / the format's bytes (metadata included); '% of ideal' = the speedup over cuDNN / ideal.",
        "",
        "| model | batch x ctx | format | ms | GB/s | % read bw | % same-size read | vs cuDNN bf16 | ideal | % of ideal | eager ms | write GB/s | write % of copy | plan | rel err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        err = "" if r["relerr_vs_fp32"] is None else f"{r['relerr_vs_fp32']:.1e}"
        eager = f"{r['eager_ms']:.3f}"
        ideal = r.get("ideal") or ideal_ratio(format_of(r["format"]), r["head_dim"])
        same = f"{100 * r['gbps'] / r['read_gbps_same_size']:.0f}%"
        lines.append(
            f"| {r['model']} | {r['batch']}x{r['ctx']} | {r['format']} | {r['ms']:.3f} | {r['gbps']:.0f} | "
            f"{100 * r['gbps'] / env['read_gbps']:.0f}% | {same} | {r['speedup']:.2f}x ({r['sdpa_ms']:.3f} ms) | "
            f"{ideal:.2f}x | {100 * r['speedup'] / ideal:.0f}% | {eager} | "
            f"{_write_cells(r, env)} | "
            f"{plan_text(DecodePlan(**r['plan']))} | {err} |"
        )
    return "\n".join(lines) + "\n"


def _write_cells(r: dict, env: dict) -> str:
    if not r.get("write_gbps"):
        return "reference op | -"
    return f"{r['write_gbps']:.0f} | {100 * r['write_gbps'] / env['copy_gbps']:.0f}%"


def check_without_gpu(grid, fmt_names) -> None:
    """Each case's default plans run once under the Triton interpreter (TRITON_INTERPRET=1, tiny --shapes) and
    checked against the fp32 reference: the benchmark's own code path, without timings."""
    global DEVICE
    DEVICE = "cpu"
    for model, batch, ctx in grid:
        case = Case(model, batch, ctx)
        for name in fmt_names:
            fmt = format_of(name)
            c = Case(model, batch, ctx, block_size=PER_CHANNEL_TOKENS) if fmt.per_channel_keys else case
            cache = c.cache(fmt)
            c.fill(cache)
            plan = plan_of(name, c, cache)
            out = decode_attention(c.q, cache, c.block_tables, c.seq_lens, c.sm_scale, plan=plan)
            ref = c.reference(cache)
            err = ((out.float() - ref).norm() / ref.norm()).item()
            print(f"{model} {batch}x{ctx} {name:14s} {plan_text(plan)} ideal x{ideal_ratio(format_of(name), case.head_dim):.2f} "
                  f"err={err:.2e}", flush=True)
            assert err < 0.05, f"{name}: relative error {err} against the fp32 reference"


def grid_of(models: str, shapes: str, quick: bool) -> list[tuple[str, int, int]]:
    """(model, batch, context) cases: the GRID over MODELS, or the given ones ("16x32768,1x131072")."""
    if quick:
        return [CHECK_SHAPE]
    names = models.split(",") if models else list(MODELS)
    unknown = [m for m in names if m not in GEOMETRIES]
    if unknown:
        raise SystemExit(f"--models: unknown {unknown}; choose from {', '.join(GEOMETRIES)}")
    cases = [tuple(int(x) for x in s.split("x")) for s in shapes.split(",")] if shapes else GRID
    return [(m, b, c) for m in names for (b, c) in cases]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--quick", action="store_true", help="only llama3-8b 16x32768")
    ap.add_argument("--models", default="", help=f"comma-separated, of {', '.join(GEOMETRIES)} (default: the grid's)")
    ap.add_argument("--shapes", default="", help="comma-separated BATCHxCONTEXT (default: the grid's)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--profile", default="", help="only run FORMAT's decode at 16x32768 a few times (under ncu)")
    ap.add_argument("--e2e", default="", help="only the end-to-end greedy check, on this device (cuda)")
    ap.add_argument("--markdown", default="", help="only rebuild kernels.md from this kernels.jsonl")
    ap.add_argument("--flush", default=DEFAULT_FLUSH, choices=FLUSH_MODES, help="how L2 is emptied before each timed call")
    args = ap.parse_args()
    global FLUSH
    FLUSH = args.flush
    if args.markdown:
        lines = [json.loads(x) for x in open(args.markdown)]
        Path(args.out, "kernels.md").write_text(markdown(lines[0], [r for r in lines if r["kind"] == "decode"]))
        return
    if args.e2e:
        end_to_end(Path(args.out), device=args.e2e)
        return
    if args.profile:
        case = Case(*CHECK_SHAPE)
        cache = case.cache(FORMATS[args.profile])
        write_kv(cache, case.k, case.v, case.slots)
        for _ in range(3):
            decode_attention(case.q, cache, case.block_tables, case.seq_lens, case.sm_scale)
        torch.cuda.synchronize()
        return
    grid = grid_of(args.models, args.shapes, args.quick)
    if not torch.cuda.is_available():  # CPU: the interpreter runs each plan once, checked; nothing is timed
        check_without_gpu(grid, args.formats.split(","))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = gpu_env(flush=FLUSH, **ceilings(FLUSH))
    print(f"{env['gpu']}: copy {env['copy_gbps']:.0f} GB/s, read {env['read_gbps']:.0f} GB/s", flush=True)
    rows: list[dict] = []
    with open(out / "kernels.jsonl", "w") as sink:
        sink.write(json.dumps(env) + "\n")
        for model, batch, ctx in grid:
            case = Case(model, batch, ctx)
            run_case(case, args.formats.split(","), rows, sink, check=(model, batch, ctx) == CHECK_SHAPE)
            del case
            torch.cuda.empty_cache()
    (out / "kernels.md").write_text(markdown(env, rows))
    print(markdown(env, rows))


if __name__ == "__main__":
    main()
