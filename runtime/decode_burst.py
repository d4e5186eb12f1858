"""Decode bursts: several greedy decode steps whose tokens stay on the device until the last.

A step of the legacy path returns [n, vocab] fp32 logits to the engine, which checks them for
NaN (one host sync), takes the argmax and reads it back (another), and builds the next step's
inputs on the host. At batch 1 on an 8B model those syncs and the host's work between two graph
replays are a large share of a step (benchmarks/step_profile.py). A burst instead runs, per
step and on the device: the model's forward, the greedy pick (argmax and whether the picked logit
is finite), a write of the pick into a ring of `steps` rows, and the next step's inputs (token,
position, length, KV slot from the block table). On CUDA one graph per batch-size bucket holds
all of it; the host replays it `steps` times back to back and reads the ring once.

Tokens are the legacy path's: the same forward on the same inputs, the same argmax over the same
fp32 logits; the one difference is the block tables' width (`table_width`: fitted to the burst's longest
sequence rather than the engine's), which only the split-K Triton attention sees, as a different
order of its fp32 sums where a context spans several splits (the batch-invariant attention's result does
not depend on it). A fitted width never changes which kernel runs (`kernel_width`). What a burst cannot do is decide between its steps: the caller gives each
sequence room for the burst's tokens beforehand and drops whatever follows a stop (the KV written
for dropped tokens lies in pages the finished sequence frees). So bursts serve greedy rows
without logit adjustments or log-probs; the step loop (runtime/step_loop.py) runs everything
else one step at a time. A burst's picks reach the host through pinned memory and an event
(`PendingBurst.read`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .cuda_graphs import bucket_for
from .kv_cache import LayerCache
from .model import LlamaModel, PagedBatch

# The bursts a single-GPU engine runs unless told otherwise (engine.json / from_dir `burst_steps`). why: 8 steps
# took the host's share of a batch-1 Llama-3-8B step from 0.74 to 0.28 ms on the H200, and a streaming caller
# then gets its tokens 8 at a time (docs/decode_step.md: benchmarks/results/step_profile.md)
DEFAULT_BURST_STEPS = 8


@dataclass
class _Buffers:
    batch: PagedBatch  # the step's inputs; each step writes the next one's
    active: torch.Tensor  # [size] int64: 1 for a real row, 0 for padding (which writes nowhere)
    ring_tokens: torch.Tensor  # [steps, size] int64: the pick of every step
    ring_finite: torch.Tensor  # [steps, size] bool: whether its logit was finite
    counter: torch.Tensor  # [1] int64: the ring row the next step writes
    host: tuple[torch.Tensor, torch.Tensor]  # [steps, size] the ring's copies on the host (pinned on CUDA)
    graph: torch.cuda.CUDAGraph | None = None


@dataclass(eq=False)
class PendingBurst:
    """A burst launched on the device, its picks on their way to the host (`read`)."""

    buf: _Buffers
    n: int  # its sequences, the buffer's first rows
    steps: int
    event: torch.cuda.Event | None

    def read(self) -> tuple[list[list[int]], list[list[bool]]]:
        """Greedy tokens [steps][n] and whether each was finite; waits for this burst only."""
        if self.event is not None:
            self.event.synchronize()
        tokens, finite = (h[: self.steps, : self.n] for h in self.buf.host)
        return tokens.tolist(), finite.tolist()


def table_width(tokens: int, block_size: int, max_blocks: int) -> int:
    """Block-table columns of a burst whose sequences reach `tokens` tokens: the next of 2**k and 3 * 2**(k-1)
    blocks, at most max_blocks. The attention kernel sizes its split-K ranges from the table's width; tables
    padded to the engine's longest sequence (as the legacy graphs pad them) give one 8k sequence in a 128k
    engine 1/16 of the splits with work, so a burst's graph is captured per width."""
    need = max(1, -(-tokens // block_size))
    width = 1 << (need - 1).bit_length()
    if width * 3 // 4 >= need:
        width = width * 3 // 4
    return min(width, max_blocks)


# the plan fields that decide a decode kernel's arithmetic (which kernel, its tiles, its dot and softmax steps); the
# others (split count, registers, ring stages, loads) only change where and when the same sums run
_ARITHMETIC = ("kernel", "block_n", "num_warps", "k_chains", "skip_rescale", "dot_fp16", "p_scale", "widen_ptx",
               "heads_n")


def decode_kernels(layers, size: int, heads: int, head_dim: int, q_dtype: torch.dtype, device
                   ) -> Callable[[int], tuple]:
    """width -> the arithmetic (`_ARITHMETIC`) of the default decode plan of every layer of `layers` ((format, KV
    heads, block size) each) for `size` rows of `heads` query heads on `device` (a tuned_file.Device), at that table
    width."""
    from .kernels.plan import decode_plan

    def kernels(width: int) -> tuple:
        plans = [decode_plan(fmt, size, heads, kv_heads, width * bs, device, head_dim=head_dim, block_size=bs,
                             q_dtype=q_dtype) for fmt, kv_heads, bs in sorted(set(layers), key=str)]
        return tuple(tuple(getattr(p, f) for f in _ARITHMETIC) for p in plans)
    return kernels


def kernel_width(width: int, max_blocks: int, kernels: Callable[[int], tuple]) -> int:
    """`width`, or the engine's full table (max_blocks, as the legacy step pads it) where the decode kernels at
    `width` (`kernels(width)`, e.g. `decode_kernels`) are not the full table's.
    why: the plan may pick another kernel for a narrow table -- static fp8 / int8 take Triton's 4-warp tile where few
    (sequence, KV head) pairs and a short table make too few one-warp programs, Gluon at the full width -- and a
    burst's tokens then differed from the ordinary step's even where one split holds the whole context. That happens
    only with few pairs, where attention is a small share of the step (Llama-3-8B FP8, one 8k sequence: ~0.13 ms of
    a 7.5 ms step)."""
    return width if kernels(width) == kernels(max_blocks) else max_blocks


class DecodeBurst:
    def __init__(self, model: LlamaModel, caches: list[LayerCache], backend, max_batch: int, max_seq_len: int,
                 block_size: int, steps: int, use_graphs: bool):
        self.model, self.caches, self.backend = model, caches, backend
        self.max_batch, self.block_size, self.steps = max_batch, block_size, steps
        self.max_blocks = -(-max_seq_len // block_size)
        self.max_position = max_seq_len - 1
        self.use_graphs = use_graphs and model.device.type == "cuda"
        self.failure: str | None = None  # why a capture failed; from then on bursts run eagerly
        self.steps_run = 0  # decode steps run in bursts so far
        self._buffers: dict[tuple[int, int], _Buffers] = {}  # by (batch bucket, block-table width)
        self._widths: dict[tuple[int, int], int] = {}  # (batch bucket, fitted width) -> the width bursts run
        model.rotary.table(model.device, max_seq_len)  # a captured graph keeps the table it saw

    def width_for(self, n: int, tokens: int) -> int:
        """The block-table width a burst of n sequences whose longest reaches `tokens` tokens runs: `table_width`'s,
        or the full table where that runs other decode kernels (`kernel_width`)."""
        size = bucket_for(n) if self.use_graphs else n
        return self._width(size, table_width(tokens, self.block_size, self.max_blocks))

    def _width(self, size: int, fitted: int) -> int:
        """`fitted`, or the full table where that runs other Triton decode kernels (`kernel_width`)."""
        key = (size, fitted)
        if key not in self._widths:
            name = getattr(self.backend, "name", "")
            if name.startswith("triton"):
                from .kernels.tuned_file import device_of

                layers = [(c.fmt, c.k.shape[1], c.k.shape[2]) for c in self.caches]
                kernels = decode_kernels(layers, size, self.model.num_heads, self.model.cfg.head_dim, self.model.dtype,
                                         device_of(self.model.device))
                self._widths[key] = kernel_width(fitted, self.max_blocks, kernels)
            else:  # the reference and the batch-invariant attention run the same sums at any width
                self._widths[key] = fitted
        return self._widths[key]

    def _make(self, size: int, width: int) -> _Buffers:
        dev = self.model.device

        def zeros(*shape, dtype=torch.int64):
            return torch.zeros(*shape, dtype=dtype, device=dev)

        batch = PagedBatch(
            input_ids=zeros(size), positions=zeros(size), slot_mapping=torch.full((size,), -1, device=dev),
            num_decode=size, block_tables=zeros(size, width, dtype=torch.int32),
            seq_lens=torch.ones(size, dtype=torch.int32, device=dev), cu_seqlens=zeros(1, dtype=torch.int32),
            logits_indices=torch.arange(size, device=dev), max_position=self.max_position,
        )
        pin = dev.type == "cuda"
        host = (torch.zeros(self.steps, size, dtype=torch.int64, pin_memory=pin),
                torch.zeros(self.steps, size, dtype=torch.bool, pin_memory=pin))
        return _Buffers(batch, zeros(size), zeros(self.steps, size), zeros(self.steps, size, dtype=torch.bool),
                        zeros(1), host)

    def _step(self, buf: _Buffers) -> None:
        """One decode step, its pick, and the next step's inputs, all on the device."""
        b = buf.batch
        logits = self.model.forward_paged(b, self.caches, self.backend)
        tokens = logits.argmax(dim=-1)
        finite = torch.isfinite(logits.gather(1, tokens[:, None])[:, 0])
        buf.ring_tokens.index_copy_(0, buf.counter, tokens[None])
        buf.ring_finite.index_copy_(0, buf.counter, finite[None])
        buf.counter.add_(1)
        b.input_ids.copy_(tokens)
        b.positions.add_(buf.active)
        b.seq_lens.add_(buf.active.to(torch.int32))
        self._next_slots(buf)

    def _next_slots(self, buf: _Buffers) -> None:
        """The KV slot of each row's position from its block table (padding rows: -1)."""
        b = buf.batch
        # past the table's end (a step after the burst's last) any page will do, the step never runs
        col = (b.positions // self.block_size).clamp_(max=b.block_tables.shape[1] - 1)
        page = b.block_tables.gather(1, col[:, None])[:, 0].to(torch.int64)
        slot = page * self.block_size + b.positions % self.block_size
        b.slot_mapping.copy_(torch.where(buf.active.bool(), slot, torch.full_like(slot, -1)))

    def _capture(self, buf: _Buffers) -> None:
        dev = self.model.device
        saved = [t.clone() for t in (buf.batch.input_ids, buf.batch.positions, buf.batch.seq_lens,
                                     buf.batch.slot_mapping, buf.counter)]
        side = torch.cuda.Stream(dev)  # warm up outside the capture (Triton compiles, the allocator settles)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            self._step(buf)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(buf)
        # the warm-up advanced the inputs (and wrote K/V where the caller's first step writes it again)
        for t, s in zip((buf.batch.input_ids, buf.batch.positions, buf.batch.seq_lens, buf.batch.slot_mapping,
                         buf.counter), saved):
            t.copy_(s)
        buf.graph = graph

    def run(self, input_ids: list[int], positions: list[int], tables: list[list[int]], steps: int
            ) -> tuple[list[list[int]], list[list[bool]]]:
        """Greedy tokens [steps][n] (and whether each was finite) for n sequences decoding from
        (last token, its position) with block tables that already hold room for `steps` tokens each."""
        return self.launch(input_ids, positions, tables, steps).read()

    def launch(self, input_ids: list[int], positions: list[int], tables: list[list[int]], steps: int
               ) -> PendingBurst:
        """`run`'s burst, launched: its tokens come with the result's `read`."""
        n = len(input_ids)
        if not 1 <= steps <= self.steps or not 1 <= n <= self.max_batch:
            raise ValueError(f"a burst takes 1..{self.steps} steps of 1..{self.max_batch} sequences")
        # padding rows write to slot -1, which only the Triton write skips (the reference one would wrap it
        # to the pool's last slot): eager bursts run exactly n rows
        size = bucket_for(n) if self.use_graphs else n
        width = self.width_for(n, max(positions) + steps)
        buf = self._buffers.get((size, width))
        if buf is None:
            buf = self._buffers[(size, width)] = self._make(size, width)
        bs = self.block_size
        b = buf.batch
        pad = size - n
        self._load_tables(buf, tables)
        b.input_ids.copy_(torch.tensor(input_ids + [0] * pad))
        b.positions.copy_(torch.tensor(positions + [0] * pad))
        b.seq_lens.copy_(torch.tensor([p + 1 for p in positions] + [1] * pad, dtype=torch.int32))

        def slots(step: int) -> list[int]:  # the KV slot each sequence writes at the burst's step
            return [t[(p + step) // bs] * bs + (p + step) % bs for t, p in zip(tables, positions)]

        b.slot_mapping.copy_(torch.tensor(slots(0) + [-1] * pad))
        buf.active.copy_(torch.tensor([1] * n + [0] * pad))
        # per-channel keys: the host's part of every step's write, before the first (runtime/channel_keys.py)
        prepare = getattr(self.backend, "prepare_burst", None)
        if prepare is not None:
            prepare(self.caches, [slots(j) for j in range(steps)])
        try:
            if self.use_graphs and self.failure is None and buf.graph is None:
                try:
                    self._capture(buf)
                except RuntimeError as e:  # an op that cannot be captured: run eagerly, say why
                    self.failure = f"{type(e).__name__}: {e}"
            return self._replay(buf, n, steps)
        finally:
            if prepare is not None:
                self.backend.end_burst(self.caches)

    def _load_tables(self, buf: _Buffers, tables: list[list[int]]) -> None:
        size, width = buf.batch.block_tables.shape
        # rows into one numpy array: a torch tensor a row (or one from nested lists) took the host 3x as long
        host_tables = np.zeros((size, width), dtype=np.int32)
        for i, t in enumerate(tables):
            host_tables[i, : min(len(t), width)] = t[:width]
        buf.batch.block_tables.copy_(torch.from_numpy(host_tables).to(self.model.device, non_blocking=True))

    def _replay(self, buf: _Buffers, n: int, steps: int) -> PendingBurst:
        """`steps` steps into the buffer's ring from its first row, whose rows then start for the host."""
        buf.counter.zero_()
        for _ in range(steps):
            if buf.graph is not None:
                buf.graph.replay()
            else:
                self._step(buf)
        self.steps_run += steps
        event = None
        for host, ring in zip(buf.host, (buf.ring_tokens, buf.ring_finite)):
            host[:steps].copy_(ring[:steps], non_blocking=ring.is_cuda)
        if self.model.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return PendingBurst(buf, n, steps, event)
