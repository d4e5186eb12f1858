"""Per-channel keys (KIVI): the write and the attention of k.int4-per_channel-asym on the reference path.

A key block (one paged block of PER_CHANNEL_TOKENS positions, one KV head) is quantized with one fp16 scale
and zero per channel, taken over its 64 keys (runtime/kv_quant.py: quantize_per_channel). Its scales need all
64 keys, so a block being written keeps its keys in fp16 in a residual block (LayerCache.k_residual, slots
handed out by kv_cache.ResidualSlots) and is quantized when its 64th key is written.

The semantics are defined by position, so that decode, chunked prefill, a whole-prompt prefill and
Engine.score compute the same attention (docs/numerics.md): a query at position p reads the keys of its own
block in fp16 (the values the residual holds) and the keys of every earlier block quantized. Sequential decode
sees exactly that; a prefill chunk that completes a block still gives that block's queries its fp16 keys (the
chunk's own keys, rounded to fp16, and the residual's for positions before the chunk). V is per-token as in
runtime/attention.py.

One query's attention is a single SDPA over [quantized keys of the blocks before the last query's block,
fp16 keys from the first query's block on] under a mask that lets each query see the quantized copy of the
blocks before its own and the fp16 copy of its own block up to itself.
"""

from __future__ import annotations

import itertools
import types
from dataclasses import dataclass, field

import torch

from .errors import NumericsError
from .kv_cache import LayerCache
from .kv_format import PER_CHANNEL_TOKENS, format_from_name
from .kv_quant import dequantize, dequantize_per_channel, quantize_per_channel

BLOCK = PER_CHANNEL_TOKENS
_KEYS = format_from_name("k.int4-per_channel-asym+v.int4-per_token-asym").k


# ------------------------------------------------------------------ write
@dataclass
class KeyWrite:
    """The host's part of one write of keys into one layer: the tokens that go to a residual slot (`slots`, one
    each), the blocks the write completes (block, its slot or None where the whole block is in the write, its
    tokens here) and the open blocks of a chunk that found no slot free (block, its tokens: their keys wait in
    ResidualSlots.deferred until the next write)."""
    to_residual: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    done: list[tuple[int, int | None, list[int]]] = field(default_factory=list)
    deferred: list[tuple[int, list[int]]] = field(default_factory=list)


def plan_write(cache: LayerCache, slots: list[int]) -> KeyWrite:
    """Hand out and give back residual slots for a write of keys at `slots` (block * BLOCK + offset; a block's
    positions in order), and move the keys a chunk deferred into their slot. A write of no tokens (a CUDA graph's
    capture) changes nothing. The reference write (`write_keys`) and the device's
    (runtime/kernels/write_channel_keys.py, which reads the slots from `ResidualSlots.slot_of`) both follow it."""
    plan = KeyWrite()
    if not slots:
        return plan
    blocks, offs = [s // BLOCK for s in slots], [s % BLOCK for s in slots]
    res = cache.residual
    res.start_write()
    for b, (offsets, keys) in list(res.deferred.items()):  # open blocks of the last write that found no slot
        cache.k_residual[res.take(b), :, offsets] = keys
        del res.deferred[b]
    tokens: dict[int, list[int]] = {}
    for t, b in enumerate(blocks):
        tokens.setdefault(b, []).append(t)
    for b, idx in tokens.items():
        first, last = offs[idx[0]], offs[idx[-1]]
        if first == 0:
            res.release(b)  # a block written from its start holds nothing from before
        elif b not in res.of_block:
            raise NumericsError(f"per-channel keys: block {b} is written from position {first} but its earlier "
                                "keys are in no residual block (a block's keys must be written in order).")
        if first == 0 and last == BLOCK - 1 and len(idx) == BLOCK:
            plan.done.append((b, None, idx))
            continue
        slot = res.take(b, required=first > 0 or len(idx) == 1)  # a decode token's query reads its block now
        if slot is None:  # a new open block of a chunk: its queries read the chunk's keys, later ones the slot
            plan.deferred.append((b, idx))
            continue
        plan.to_residual += idx
        plan.slots += [slot] * len(idx)
        if last == BLOCK - 1:
            plan.done.append((b, slot, idx))
            res.completed(b)
    return plan


def store_deferred(cache: LayerCache, k: torch.Tensor, slot_mapping: torch.Tensor, plan: KeyWrite) -> None:
    """Keep the fp16 keys of the plan's deferred blocks for the next write."""
    offs = slot_mapping % BLOCK if plan.deferred else None
    for b, idx in plan.deferred:
        t = torch.tensor(idx, device=k.device)
        cache.residual.deferred[b] = (offs[t], k[t].to(torch.float16).transpose(0, 1))


def write_keys(cache: LayerCache, k: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k [T, kv_heads, head_dim] at `slot_mapping`: into the residual of open blocks; blocks whose last key this
    write holds are quantized into the pages (from the residual, or straight from k when the whole block is in
    this write)."""
    plan = plan_write(cache, slot_mapping.tolist())
    store_deferred(cache, k, slot_mapping, plan)
    offs = slot_mapping % BLOCK
    kh = k.to(torch.float16)
    if plan.to_residual:
        t = torch.tensor(plan.to_residual, device=k.device)
        cache.k_residual[torch.tensor(plan.slots, device=k.device), :, offs[t]] = kh[t]
    if not plan.done:
        return
    full = []
    for _, slot, idx in plan.done:
        if slot is not None:
            full.append(cache.k_residual[slot])
        else:
            x = torch.empty_like(cache.k_residual[0])
            x[:, offs[torch.tensor(idx, device=k.device)]] = kh[idx].transpose(0, 1)
            full.append(x)
    q, scale, zero = quantize_per_channel(torch.stack(full), cache.fmt.k)
    ids = torch.tensor([b for b, _, _ in plan.done], device=k.device)
    cache.k[ids], cache.k_scale[ids], cache.k_zero[ids] = q, scale, zero


# ------------------------------------------------------------------- read
def quantized_keys(cache: LayerCache, table: torch.Tensor) -> torch.Tensor:
    """The dequantized fp32 keys of the complete blocks `table` [n]: [kv_heads, n * BLOCK, head_dim]."""
    ids = table.long()
    k = dequantize_per_channel(cache.k[ids], cache.k_scale[ids], cache.k_zero[ids])  # [n, H, BLOCK, D]
    return k.transpose(0, 1).reshape(k.shape[1], -1, k.shape[-1])


def values(cache: LayerCache, table: torch.Tensor, n: int) -> torch.Tensor:
    """The first n values of a sequence, dequantized (per token): [kv_heads, n, head_dim] fp32."""
    ids = table[:-(-n // BLOCK)].long()
    fmt = cache.fmt.v

    def pages(t: torch.Tensor) -> torch.Tensor:
        g = t[ids].transpose(0, 1)  # [H, nb, BLOCK, ...]
        return g.reshape(g.shape[0], -1, *g.shape[3:])[:, :n]

    zero = pages(cache.v_zero) if cache.v_zero is not None else None
    return dequantize(pages(cache.v), fmt, pages(cache.v_scale), zero, torch.float32)


def read_keys(cache: LayerCache, blocks: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Keys at (blocks, offs) as stored: fp16 from the residual while their block has one, else dequantized
    from the pages. [T, kv_heads, head_dim] fp32."""
    out = dequantize_per_channel(cache.k[blocks, :, offs].unsqueeze(-2), cache.k_scale[blocks],
                                 cache.k_zero[blocks]).squeeze(-2)
    slots = [cache.residual.of_block.get(b, -1) for b in blocks.tolist()]
    open_ = torch.tensor([s >= 0 for s in slots], device=out.device)
    if bool(open_.any()):
        s = torch.tensor(slots, device=out.device)[open_]
        out[open_] = cache.k_residual[s, :, offs[open_]].to(torch.float32)
    return out


# -------------------------------------------------------------- attention
def attend(q: torch.Tensor, cache: LayerCache, table: torch.Tensor, ctx: int, k: torch.Tensor | None,
           v: torch.Tensor | None, sm_scale: float, sdpa) -> torch.Tensor:
    """q [Tq, heads, D] of one sequence at positions ctx .. ctx + Tq - 1, its block table `table` [>= blocks];
    k / v [Tq, kv_heads, D] the keys (as computed) and values (as stored) of those positions, or None for a
    decode step (Tq 1: its key and value are read from the cache). `sdpa(q, k, v, scale, mask)` attends."""
    end = ctx + q.shape[0]
    own0, own1 = ctx // BLOCK * BLOCK, (end - 1) // BLOCK * BLOCK  # first and last query's block start
    fp16 = []
    if ctx > own0 or k is None:  # the first query's block before the chunk (all of it up to the query: decode)
        slot = cache.residual.of_block.get(int(table[own0 // BLOCK]))
        if slot is None:
            raise NumericsError(f"per-channel keys: the block at position {own0} has no fp16 residual block.")
        fp16.append(cache.k_residual[slot, :, :(end if k is None else ctx) - own0])
    if k is not None:
        fp16.append(k.to(torch.float16).transpose(0, 1))
    if v is None:
        vs = values(cache, table, end)
    else:
        vs = v.to(torch.float32).transpose(0, 1)
        vs = torch.cat((values(cache, table, ctx), vs), 1) if ctx else vs
    return _attend(q, ctx, quantized_keys(cache, table[:own1 // BLOCK]), torch.cat(fp16, 1), vs, sm_scale, sdpa)


def attend_prompt(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, sdpa) -> torch.Tensor:
    """`attend` for a prompt from position 0 (no cached context): the blocks before the last query's are
    quantized from the prompt's own keys, the values write_keys stores for them."""
    kh = k.to(torch.float16)
    own1 = (k.shape[0] - 1) // BLOCK * BLOCK
    blocks = kh[:own1].unflatten(0, (-1, BLOCK)).transpose(1, 2)  # [n, H, BLOCK, D]
    kq = dequantize_per_channel(*quantize_per_channel(blocks, _KEYS))
    kq = kq.transpose(0, 1).reshape(k.shape[1], own1, k.shape[2])
    return _attend(q, 0, kq, kh.transpose(0, 1), v.to(torch.float32).transpose(0, 1), sm_scale, sdpa)


def _attend(q: torch.Tensor, ctx: int, kq: torch.Tensor, kf: torch.Tensor, vs: torch.Tensor, sm_scale: float,
            sdpa) -> torch.Tensor:
    """kq [kv_heads, own1, D]: the quantized keys of the blocks before the last query's block; kf [kv_heads,
    end - own0, D]: the fp16 keys from the first query's block on; vs [kv_heads, end, D]: every value."""
    end = ctx + q.shape[0]
    own0, own1 = ctx // BLOCK * BLOCK, kq.shape[1]
    math = q.dtype if q.is_cuda else torch.float32
    keys = torch.cat((kq.to(math), kf.to(math)), 1)
    vals = torch.cat((vs[:, :own1], vs[:, own0:]), 1).to(math)
    pos = torch.arange(ctx, end, device=q.device)[:, None]
    start = pos // BLOCK * BLOCK  # each query's own block
    own = torch.arange(own0, end, device=q.device)[None, :]
    mask = torch.cat((torch.arange(own1, device=q.device)[None, :] < start, (own >= start) & (own <= pos)), 1)
    return sdpa(q.transpose(0, 1).to(math), keys, vals, sm_scale, mask).transpose(0, 1).to(q.dtype)


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, cache: LayerCache,
            block_tables: torch.Tensor | None, context_lens: list[int], sm_scale: float, sdpa) -> torch.Tensor:
    """attention.prefill_context_attention for per-channel keys: k as computed, v as stored; each packed
    sequence from its context (block_tables may be None where every context is empty)."""
    out = torch.empty_like(q)
    for i, (a, b) in enumerate(itertools.pairwise(cu_seqlens.tolist())):
        if b > a:
            ctx = context_lens[i]
            out[a:b] = (attend(q[a:b], cache, block_tables[i], ctx, k[a:b], v[a:b], sm_scale, sdpa) if ctx
                        else attend_prompt(q[a:b], k[a:b], v[a:b], sm_scale, sdpa))
    return out


def decode_attention(q: torch.Tensor, cache: LayerCache, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                     sm_scale: float, sdpa) -> torch.Tensor:
    """attention.decode_attention for per-channel keys: each sequence's query at position seq_len - 1."""
    return torch.cat([attend(q[i:i + 1], cache, block_tables[i], n - 1, None, None, sm_scale, sdpa)
                      for i, n in enumerate(seq_lens.tolist())])


# ---------------------------------------------------------------- backend
def kernels_backend(backend: types.SimpleNamespace, ref: types.SimpleNamespace) -> types.SimpleNamespace:
    """The CUDA backend of an engine with per-channel-key layers. Their write is the device kernel's
    (runtime/kernels/write_channel_keys.py) after the host's part (`plan_write`), which `prepare_write` does for a
    step before its forward (ModelRunner.build_batch): a decode step then does no host work and is one CUDA graph;
    `prepare_burst` does it for all steps of a decode burst (runtime/decode_burst.py) before they run.
    A write nobody prepared (a direct caller of forward_paged) plans from its slot_mapping, a host sync. Their decode
    is the kernels' (decode_channel_keys.py), their chunked prefill the reference op's."""
    def prepare_write(caches: list[LayerCache], slot_mapping: torch.Tensor, slots: list[int]) -> None:
        for cache in caches:
            if cache.fmt.per_channel_keys:
                cache.residual.prepared = (slot_mapping, plan_write(cache, slots))

    def write_kv(cache: LayerCache, k, v, slot_mapping, **plan):
        if not cache.fmt.per_channel_keys:
            return backend.write_kv(cache, k, v, slot_mapping, **plan)
        prepared, cache.residual.prepared = cache.residual.prepared, None
        if prepared is not None and prepared[0] is slot_mapping:
            key_write = prepared[1]
        elif cache.residual.planned_ahead:  # a burst's step: prepare_burst planned it (decode tokens defer nothing)
            key_write = KeyWrite()
        elif k.is_cuda and torch.cuda.is_current_stream_capturing():
            key_write = KeyWrite()  # a CUDA graph's write: prepare_write plans each replay's before it
        else:
            slots = slot_mapping.tolist()
            n = next((i for i, s in enumerate(slots) if s < 0), len(slots))
            if any(s >= 0 for s in slots[n:]):
                raise ValueError("per-channel keys: negative slots (padding) may only end a write's slot_mapping")
            key_write = plan_write(cache, slots[:n])
        backend.write_kv(cache, k, v, slot_mapping)
        store_deferred(cache, k, slot_mapping, key_write)

    def prepare_burst(caches: list[LayerCache], steps: list[list[int]]) -> None:
        """The host's part of a decode burst's writes, `steps` (each step's slots, one a sequence), before it
        runs: every step planned in order, so `slot_of` holds each step's blocks (a block's slot changes hands
        only at the write after its last key, as step by step); `end_burst` once the steps are enqueued."""
        for cache in caches:
            if cache.fmt.per_channel_keys:
                cache.residual.plan_ahead()
                for slots in steps:
                    plan_write(cache, slots)

    def end_burst(caches: list[LayerCache]) -> None:
        for cache in caches:
            if cache.fmt.per_channel_keys:
                cache.residual.end_burst()

    def prefill_context_attention(q, k, v, cu_seqlens, cache: LayerCache, *args, **plan):
        if cache.fmt.per_channel_keys:
            return ref.prefill_context_attention(q, k, v, cu_seqlens, cache, *args)
        return backend.prefill_context_attention(q, k, v, cu_seqlens, cache, *args, **plan)

    return types.SimpleNamespace(**dict(vars(backend), write_kv=write_kv, prepare_write=prepare_write,
                                        prepare_burst=prepare_burst, end_burst=end_burst,
                                        prefill_context_attention=prefill_context_attention,
                                        name=backend.name + " (per-channel keys: chunked prefill reference)"))


# ----------------------------------------------------------------- engine
def check_engine(formats, block_size: int, device: torch.device, *, tensor_parallel: bool, batch_invariant: bool
                 ) -> None:
    """What an engine with per-channel-key layers needs: blocks of PER_CHANNEL_TOKENS positions and one process
    (the host keeps the residual slots); on CUDA the batch-invariant mode's kernels do not read these keys."""
    if not any(f.per_channel_keys for f in formats):
        return
    from .errors import UnsupportedError

    name = next(f.name for f in formats if f.per_channel_keys)
    if block_size != BLOCK:
        raise UnsupportedError(f"{name} scales each key channel over one block of {BLOCK} positions: build the "
                               f"engine with block_size {BLOCK} (got {block_size}).")
    if tensor_parallel:
        raise UnsupportedError(f"{name} keeps its keys' fp16 residual blocks in one process, which rules out tensor "
                               "parallelism; build the engine with tp: 1 or use another KV format.")
    if batch_invariant and device.type == "cuda":
        raise UnsupportedError(f"the batch-invariant mode's CUDA kernels do not read {name}'s per-channel keys; "
                               "build the engine with batch_invariant: false or use another KV format.")


def release_on_free(blocks, caches: list[LayerCache]) -> None:
    """Give a freed block's residual slot back in every per-channel-key layer (a sequence that ends inside a
    block leaves its last block open)."""
    slots = [c.residual for c in caches if c.residual is not None]
    if slots:
        blocks.on_free.append(lambda b: [s.release(b) for s in slots])
