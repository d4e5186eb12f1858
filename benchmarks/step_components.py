"""The pieces of one decode step, each timed alone at a scenario's shapes, with its byte and FLOP bound.

Used by benchmarks/step_profile.py. Every component runs what LlamaModel.forward_paged runs for it, for all
layers of one step (each layer's own weights, so nothing is served from L2 that a real step reads from
HBM): on CUDA captured in a CUDA graph and timed by replay (GPU time, no host), on the CPU eagerly.
Op sets: `legacy` (torch norms, RoPE, SwiGLU; the host's sampling), `burst` (those ops; the pick and next inputs
of a decode burst on the device), `fused` and `invariant` (a burst through the backend's small ops of
runtime/kernels/small_ops.py where it has them, and its matmul).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from runtime.batch_invariant import fast_linear
from runtime.decode_burst import table_width
from runtime.kv_format import kv_bytes_per_token


@dataclass
class Component:
    name: str
    fn: Callable[[], object]  # one step's worth: every layer
    bytes: float  # HBM bytes the step must move for it at least
    flops: float = 0.0


def time_ms(fn: Callable[[], object], device: torch.device, reps: int = 20) -> float:
    """Median ms of fn: CUDA graph replays timed by events on CUDA (GPU time only), wall time on the CPU."""
    if device.type != "cuda":
        fn()
        times = []
        for _ in range(max(3, reps // 4)):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()  # compile / warm the allocator outside the capture
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_ms(graph.replay, reps)


def replay_ms(replay: Callable[[], None], reps: int = 20) -> float:
    """Median GPU ms of one call of `replay` (a graph replay), timed one by one with CUDA events."""
    for _ in range(3):
        replay()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def kernels_per_call(replay: Callable[[], None]) -> int | None:
    """CUDA kernels one call of `replay` (a captured step's replay) launches, as the profiler sees them (None if it
    sees none): at batch 1 on a small model the step's time is about its launches, not its bytes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))]
    return len(kernels) or None


def components(engine, tables: list[list[int]], ctx: int, ops_set: str, small_ops=None, backend=None,
               width: int | None = None) -> list[Component]:
    """One step's components for n = len(tables) sequences at context ctx, through `backend` (`engine`'s by
    default) and its matmul (the invariant mode's GEMM, the fused step's skinny-matmul rule), with block tables of
    `width` blocks (a burst's: DecodeBurst.width_for; None: the legacy graphs' or the fitted width)."""
    model, cfg = engine.model, engine.cfg
    backend = backend if backend is not None else engine.backend
    lin = getattr(backend, "linear", fast_linear)
    caches = engine.runner.caches
    dev, dt = model.device, model.dtype
    n, hid, nl = len(tables), cfg.hidden_size, cfg.num_layers
    heads, kvh, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    bs = engine.stats.block_size
    el = torch.finfo(dt).bits // 8
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=g).to(dt)

    x = randn(n, hid)
    layers = [model.layer(i) for i in range(nl)]
    # the legacy graphs pad block tables to the engine's longest sequence, bursts fit them to theirs
    if width is None:
        width = -(-engine.max_seq_len // bs) if ops_set == "legacy" else table_width(ctx + 1, bs, 1 << 30)
    block_tables = torch.tensor([t[:width] + [0] * (width - len(t[:width])) for t in tables], dtype=torch.int32,
                                device=dev)
    seq_lens = torch.full((n,), ctx + 1, dtype=torch.int32, device=dev)
    slots = torch.tensor([t[ctx // bs] * bs + ctx % bs for t in tables], dtype=torch.int64, device=dev)
    positions = torch.full((n,), ctx, dtype=torch.int64, device=dev)
    ids = torch.randint(3, cfg.vocab_size, (n,), device=dev, generator=g)
    q, k, v = randn(n, heads, d), randn(n, kvh, d), randn(n, kvh, d)
    qkv = randn(n, (heads + 2 * kvh) * d)
    gate_up = randn(n, 2 * cfg.intermediate_size)
    act = randn(n, cfg.intermediate_size)
    logits = torch.randn(n, cfg.vocab_size, device=dev, generator=g)
    cos_t, sin_t = model.rotary.table(dev, engine.max_seq_len)

    def per_layer(fn):
        return lambda: [fn(i) for i in range(nl)]

    def gemm(name: str, weight: Callable[[int], torch.Tensor], inp: torch.Tensor) -> Component:
        w0 = weight(0)
        out_f, in_f = w0.shape
        return Component(name, per_layer(lambda i: lin(inp, weight(i))),
                         nl * (out_f * in_f + n * (in_f + out_f)) * el, nl * 2.0 * n * out_f * in_f)

    kv_read = n * ctx * kv_bytes_per_token(cfg, engine.fmt)  # every layer's K/V of the context, once
    act_bytes = n * hid * el
    out = [
        Component("embed", lambda: model.embed(ids), act_bytes),
        gemm("qkv_gemm", lambda i: layers[i].qkv, x),
        gemm("o_gemm", lambda i: layers[i].o, randn(n, heads * d)),
        gemm("gate_up_gemm", lambda i: layers[i].gate_up, x),
        gemm("down_gemm", lambda i: layers[i].down, act),
        Component("kv_write", per_layer(lambda i: backend.write_kv(caches[i], k, v, slots)),
                  n * (2 * kvh * d * el + kv_bytes_per_token(cfg, engine.fmt))),
        Component("attention", per_layer(lambda i: backend.decode_attention(
            q, caches[i], block_tables, seq_lens, model.sm_scale)), kv_read + nl * 2 * n * heads * d * el),
        Component("lm_head", lambda: lin(x, model.lm_head).to(torch.float32),
                  cfg.vocab_size * hid * el + n * cfg.vocab_size * 4, 2.0 * n * cfg.vocab_size * hid),
    ]
    norm_bytes = (2 * nl + 1) * 3 * act_bytes  # h (and the residual's delta) in, normed out
    if small_ops is None:  # legacy and burst (and the invariant mode on the CPU): the torch small ops
        out += [
            Component("norms", lambda: [model._rms_norm(x, w) for layer in layers
                                        for w in (layer.input_norm, layer.post_norm)] + [
                model._rms_norm(x, model.final_norm)], norm_bytes),
            Component("rope", lambda: [model.rope(qkv, *model.rotary.cos_sin(positions, dt, engine.max_seq_len - 1))
                                       for _ in range(nl)], nl * 2 * n * (heads + kvh) * d * el),
            Component("residual_swiglu", per_layer(lambda i: (x + x, F.silu(gate_up[:, :act.shape[1]]) *
                                                               gate_up[:, act.shape[1]:], x + x)),
                      nl * (6 * act_bytes + 3 * act.numel() * el)),
        ]
    else:
        out += [
            Component("norms", lambda: [small_ops.add_rms_norm(x, x, layer.post_norm, cfg.rms_norm_eps)
                                        for layer in layers for _ in range(2)] + [
                small_ops.add_rms_norm(x, None, model.final_norm, cfg.rms_norm_eps)], norm_bytes),
            Component("rope", per_layer(lambda i: small_ops.rope_qk(qkv, cos_t, sin_t, positions, heads, kvh, d)),
                      nl * 2 * n * (heads + kvh) * d * el),
            Component("residual_swiglu", per_layer(lambda i: small_ops.swiglu(gate_up)), nl * 3 * act.numel() * el),
        ]
    if ops_set == "legacy":  # the graph's logits cloned, checked and picked for the host
        out.append(Component("sampling", lambda: _legacy_pick(logits), 3 * n * cfg.vocab_size * 4))
    else:
        out.append(Component("sampling", lambda: _device_pick(logits), n * cfg.vocab_size * 4))
    return out


def _legacy_pick(logits: torch.Tensor):
    """The device part of the legacy step's sampling: the graph output's clone, the runner's NaN check over
    every logit, the argmax and the picked logit's check (the host reads the last two back)."""
    x = logits.clone()
    finite = torch.isfinite(x).all()
    best = x.argmax(dim=-1)
    return finite, torch.stack([best, torch.isfinite(x.gather(1, best[:, None])[:, 0]).long()])


def _device_pick(logits: torch.Tensor):
    """A burst's pick (runtime/decode_burst.py): argmax and the picked logit's check; nothing leaves the GPU."""
    best = logits.argmax(dim=-1)
    return best, torch.isfinite(logits.gather(1, best[:, None])[:, 0])


def bound_ms(c: Component, bandwidth_gbs: float, tflops: float) -> float:
    return max(c.bytes / (bandwidth_gbs * 1e6), c.flops / (tflops * 1e9))


def split_sweep(engine, table: list[int], ctx: int, bandwidth_gbs: float, reps: int = 20) -> list[dict]:
    """Batch-1 attention (all layers) at split counts around the default plan's, with the block table padded
    to the engine's longest sequence (the legacy graphs) and fitted to this one (decode bursts): GPU ms and
    % of the K/V read bound. CUDA and the Triton kernels only."""
    from dataclasses import replace

    from runtime.kernels import decode_attention, decode_plan_for

    model, cfg, caches = engine.model, engine.cfg, engine.runner.caches
    dev, bs = model.device, engine.stats.block_size
    q = torch.randn(1, cfg.num_heads, cfg.head_dim, device=dev).to(model.dtype)
    seq_lens = torch.full((1,), ctx + 1, dtype=torch.int32, device=dev)
    bound = ctx * kv_bytes_per_token(cfg, engine.fmt) / (bandwidth_gbs * 1e6)
    rows = []
    for label, width in (("engine", -(-engine.max_seq_len // bs)), ("fitted", table_width(ctx + 1, bs, 1 << 30))):
        bt = torch.tensor([table[:width] + [0] * (width - len(table[:width]))], dtype=torch.int32, device=dev)
        default = decode_plan_for(q, caches[0], bt)
        for splits in sorted({max(1, default.splits // 2), default.splits, default.splits * 2, default.splits * 4}):
            plan = replace(default, splits=splits)
            try:
                ms = time_ms(lambda bt=bt, plan=plan: [decode_attention(q, c, bt, seq_lens, model.sm_scale, plan=plan)
                                                       for c in caches], dev, reps)
            except Exception as e:  # noqa: BLE001 - a plan the kernel refuses: say so, keep the others
                print(f"splits={splits} ({label} table): {type(e).__name__}: {e}", flush=True)
                continue
            rows.append({"kind": "splits", "table": label, "width_tokens": width * bs, "kernel": plan.kernel,
                         "splits": splits, "default": splits == default.splits, "ms": ms, "bound_ms": bound,
                         "pct_of_bound": 100 * bound / ms})
    return rows


def attention_plans(engine, ctx: int) -> list[dict]:
    """The default decode-attention plan of one sequence at ctx tokens, for the legacy graphs' table (padded to the
    engine's longest sequence) and a burst's (fitted): kernel, splits that the launch runs, programs, and how they
    spread over the SMs -- the data behind the batch-1 split choice (runtime/kernels/tuning.py)."""
    import triton

    from runtime.kernels import decode_plan_for
    from runtime.kernels.plan import split_tile
    from runtime.kernels.split_k import split_tokens
    from runtime.kernels.tuned_file import device_of

    model, cfg, bs = engine.model, engine.cfg, engine.stats.block_size
    q = torch.empty(1, cfg.num_heads, cfg.head_dim, device=model.device, dtype=model.dtype)
    sms = device_of(model.device).sms
    rows = []
    for label, width in (("engine", -(-engine.max_seq_len // bs)), ("fitted", table_width(ctx + 1, bs, 1 << 30))):
        bt = torch.zeros(1, width, dtype=torch.int32, device=model.device)
        plan = decode_plan_for(q, engine.runner.caches[0], bt)
        tokens = width * bs
        splits = triton.cdiv(tokens, split_tokens(tokens, plan.splits, split_tile(plan)))
        programs = model.num_kv_heads * splits
        rows.append({"kind": "plan", "table": label, "width_tokens": tokens, "kernel": plan.kernel,
                     "splits": splits, "ring_stages": plan.stages, "programs": programs, "sms": sms,
                     "sms_with_work": min(sms, programs), "programs_per_sm": programs / sms})
    return rows
