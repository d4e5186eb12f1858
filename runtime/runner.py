"""Model runner: the paged KV pool, its sizing, and one step of the model.

Turns a scheduler `Step` into a flattened `PagedBatch` (decode tokens, then
prefill sequences or chunks of them), runs the model through the chosen attention
backend and returns the logits of the last token of every sequence sampled this step.

Pool sizing uses `kv_format.kv_bytes_per_token` -- the same function the
planner uses -- so planned and allocated pool sizes agree by construction:
num_blocks = budget // (block_size * bytes_per_token).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .block_manager import BlockManager
from .config import ModelConfig, ceil_div
from .cuda_graphs import DecodeGraphs
from .errors import InputError, NumericsError
from .kv_cache import LayerCache, allocate_layer
from .kv_format import KVFormat, kv_bytes_per_token, resident_seqs, residual_bytes, residual_slots
from .layer_formats import as_layer_formats
from .model import LlamaModel, PagedBatch
from .scheduler import Step

# Without a GPU to measure, a CPU pool defaults to at most this much KV memory.
CPU_DEFAULT_POOL_BYTES = 256 * 2**20


@dataclass(frozen=True)
class PoolPlan:
    num_blocks: int
    block_size: int
    bytes_per_token: float
    source: str  # how the size was chosen: num_blocks / memory_budget / gpu_free_memory / cpu_default
    residual_slots: int = 1  # per-channel keys: fp16 residual blocks per layer, one per resident sequence

    @property
    def tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def bytes(self) -> int:
        return int(self.tokens * self.bytes_per_token)


def plan_pool(
    cfg: ModelConfig,
    fmt: KVFormat | Sequence[KVFormat],
    block_size: int,
    *,
    num_blocks: int | None = None,
    memory_budget: int | None = None,
    gpu_free_budget: int | None = None,
    default_tokens: int = 0,
    tp: int = 1,
    max_num_seqs: int = 1,
    seq_tokens: int | None = None,
) -> PoolPlan:
    """Blocks for the pool, from (first given wins) an explicit count, a byte budget,
    the measured free GPU memory, or a default token count capped for the CPU.
    `fmt`: one format, or one per layer (bytes per token are the sum over layers). With tp ranks, bytes
    are per rank: the most loaded rank's share of the KV heads. Per-channel-key layers' fp16 residual blocks
    (kv_format.residual_bytes) come out of a byte budget first: one per sequence that can be resident, i.e.
    max_num_seqs, or, given `seq_tokens` (the tokens a sequence is sized for), at most the sequences of that
    length the budget holds with their residual (kv_format.resident_seqs), so the residual does not eat the pool."""
    bpt = kv_bytes_per_token(cfg, fmt, tp)
    per_block = block_size * bpt
    budget = memory_budget if memory_budget is not None else gpu_free_budget
    slots = max_num_seqs
    one = residual_bytes(cfg, fmt, 1, tp)
    if num_blocks is None and budget is not None and seq_tokens and one:
        fit = resident_seqs(budget, ceil_div(seq_tokens, block_size) * per_block, one, max_num_seqs)
        slots = max(1, min(max_num_seqs, fit))
    residual = residual_bytes(cfg, fmt, slots, tp)
    if num_blocks is not None:
        n, src = int(num_blocks), "num_blocks"
    elif memory_budget is not None:
        n, src = int((memory_budget - residual) // per_block), "memory_budget"
    elif gpu_free_budget is not None:
        n, src = int((gpu_free_budget - residual) // per_block), "gpu_free_memory"
    else:
        tokens = min(default_tokens, int(CPU_DEFAULT_POOL_BYTES // bpt))
        n, src = -(-tokens // block_size), "cpu_default"
    if n < 1:
        raise InputError(
            f"the KV pool would hold no block ({src}: {block_size} tokens x {bpt:.0f} bytes/token per block); "
            "raise memory_budget / num_blocks / gpu_memory_fraction, or use a smaller KV format."
        )
    return PoolPlan(n, block_size, bpt, src, slots)


def allocate_pool(
    cfg: ModelConfig,
    fmt: KVFormat | Sequence[KVFormat],
    plan: PoolPlan,
    device: torch.device,
    k_scales: torch.Tensor | Sequence[torch.Tensor | None] | None,
    v_scales: torch.Tensor | Sequence[torch.Tensor | None] | None,
    kv_heads: int | None = None,
    max_num_seqs: int = 1,
) -> list[LayerCache]:
    """One LayerCache per layer, each in its layer's format. Block ids are shared by all layers:
    every layer's pool has plan.num_blocks blocks, each in that layer's bytes per block.
    Static scales: a tensor [layers] / [layers, kv_heads] or one entry per layer (None where dynamic).
    kv_heads: the heads this process caches (a tensor-parallel rank's share), default all. max_num_seqs: the
    sequences run at once, which size per-channel-key layers' fp16 residual blocks (kv_format.residual_slots)."""
    formats = as_layer_formats(fmt, cfg.num_layers)
    return [
        allocate_layer(
            f, plan.num_blocks, plan.block_size, kv_heads or cfg.num_kv_heads, cfg.head_dim, device,
            k_scales[i] if k_scales is not None else None,
            v_scales[i] if v_scales is not None else None, residual_slots(max_num_seqs),
        )
        for i, f in enumerate(formats)
    ]


class ModelRunner:
    def __init__(self, model: LlamaModel, caches: list[LayerCache], blocks: BlockManager, backend,
                 graphs: DecodeGraphs | None = None):
        self.model = model
        self.caches = caches
        self.blocks = blocks
        self.backend = backend
        self.device = model.device
        self.graphs = graphs

    def build_batch(self, step: Step) -> PagedBatch:
        bs = self.blocks.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        seq_lens: list[int] = []
        for seq in step.decode:
            pos = seq.num_tokens - 1
            table = self.blocks.block_table(seq.request_id)
            ids.append(seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1])  # not token_ids: a copy of all
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            tables.append(table)
            seq_lens.append(seq.num_tokens)
        cu = [0]
        last = list(range(len(step.decode)))
        context: list[int] = []
        prefill_tables: list[list[int]] = []
        for seq, (start, end) in zip(step.prefill, step.spans):
            table = self.blocks.block_table(seq.request_id)
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            cu.append(cu[-1] + end - start)
            if end == seq.num_tokens:  # the last chunk: this sequence is sampled
                last.append(len(step.decode) + cu[-1] - 1)
            context.append(start)
            prefill_tables.append(table)

        def tensor(x, dtype):
            return torch.tensor(x, dtype=dtype).to(self.device, non_blocking=True)

        def table_tensor(rows: list[list[int]]) -> torch.Tensor:
            width = max((len(t) for t in rows), default=1)
            return tensor([t + [0] * (width - len(t)) for t in rows], torch.int32).view(len(rows), width)

        chunked = any(context)
        batch = PagedBatch(
            input_ids=tensor(ids, torch.int64),
            positions=tensor(positions, torch.int64),
            slot_mapping=tensor(slots, torch.int64),
            num_decode=len(step.decode),
            block_tables=table_tensor(tables),
            seq_lens=tensor(seq_lens, torch.int32),
            cu_seqlens=tensor(cu, torch.int32),
            logits_indices=tensor(last, torch.int64),
            max_position=max(positions, default=0),
            context_lens=tensor(context, torch.int32) if chunked else None,
            prefill_block_tables=table_tensor(prefill_tables) if chunked else None,
        )
        prepare = getattr(self.backend, "prepare_write", None)
        if prepare is not None:  # the host's part of the write, before the step (runtime/channel_keys.py)
            prepare(self.caches, batch.slot_mapping, slots)
        return batch

    def forward(self, batch: PagedBatch) -> torch.Tensor:
        """fp32 logits of every sequence's last token: decode-only steps replay a CUDA graph
        where the runner has them (`cuda_graphs.DecodeGraphs`), everything else runs eagerly."""
        if self.graphs is not None:
            logits = self.graphs.run(batch)
            if logits is not None:
                return logits
        return self.model.forward_paged(batch, self.caches, self.backend)

    def run(self, step: Step) -> torch.Tensor:
        """fp32 logits [len(step.sampled), vocab]: no row for a prefill chunk that is not its sequence's last."""
        logits = self.forward(self.build_batch(step))
        # one NaN or inf anywhere makes the sum non-finite (finite logits are far too small to overflow it):
        # a reduction instead of a [rows, vocab] mask, ~30x cheaper at 8 rows of SmolLM2's 49152 on the CPU
        if not bool(torch.isfinite(logits.sum())):
            raise NumericsError(
                "the model produced NaN/Inf logits; check the weights (convert stage), use float32/bfloat16 "
                "instead of float16, or check the KV scales (calibrate stage)."
            )
        return logits

    def close(self) -> None:
        """Release what the runner holds beyond its tensors (a tensor-parallel group's ranks)."""


def gpu_pool_budget(model: LlamaModel, step_tokens: int, fraction: float) -> int:
    """Bytes for the KV pool: `fraction` of the free GPU memory after the weights,
    minus the activation peak of a warm-up forward over a full step of tokens."""
    dev = model.device
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    ids = torch.zeros(min(step_tokens, model.cfg.max_position_embeddings), dtype=torch.int64, device=dev)
    model.forward_dense(ids)
    torch.cuda.synchronize(dev)
    activations = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(dev)
    return int(fraction * free - activations)
