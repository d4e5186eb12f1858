"""Which part of every weight, KV head and vocabulary row one tensor-parallel rank holds.

Megatron-style: q/k/v and gate/up are column-parallel (each rank holds a block of
output rows), o and down are row-parallel (a block of input columns, partial sums
all-reduced), embedding and LM head are vocabulary-parallel (a block of rows,
padded to ceil(vocab / tp) per rank as TensorRT-LLM pads its lm_head).

Attention is split by KV head and a rank takes the query heads of its KV heads, so
GQA groups never straddle ranks. When tp exceeds the KV heads, each KV head is
duplicated onto tp / kv_heads ranks and those ranks split its query heads -- the
rule TensorRT-LLM's `dup_kv_weight` follows, and the one kvq's TensorRT-LLM
checkpoint writer (builder/trtllm/checkpoint.py) takes from `rank_shard` below.

TensorRT-LLM needs equal shares (`check_parallelism(..., even=True)`). The embedded
engine also runs uneven ones (SmolLM2's 3 KV heads over 2 ranks: 2 + 1): the first
ranks take one KV head (and one MLP row) more, which is the "most loaded rank" the
planner's `kv_bytes_per_token(cfg, fmt, tp)` sizes every rank's pool for.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import ModelConfig, ceil_div
from ..errors import UnsupportedError


@dataclass(frozen=True)
class RankShard:
    """Half-open index ranges into the full model that rank `rank` of `tp` holds."""

    tp: int
    rank: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range  # real rows; the rank's table is padded to `vocab_per_rank` rows
    vocab_per_rank: int


def _block(total: int, parts: int, index: int) -> range:
    """`index`-th of `parts` near-equal blocks of range(total); the first total % parts are one longer."""
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return range(lo, lo + base + (index < extra))


def check_parallelism(cfg: ModelConfig, tp: int, pp: int = 1, *, even: bool = True) -> None:
    """UnsupportedError naming every field that forbids this split. `even`: every rank gets an
    equal share of heads and MLP rows (TensorRT-LLM); otherwise KV heads (with their query heads)
    and MLP rows may be split unevenly, as the embedded engine allows."""
    problems = []
    kv, heads = cfg.num_kv_heads, cfg.num_heads
    if tp < 1 or pp < 1:
        problems.append(f"tp ({tp}) and pp ({pp}) must be >= 1")
    else:
        if even and heads % tp:
            problems.append(f"num_attention_heads {heads} is not divisible by tp {tp}")
        if even and kv >= tp and kv % tp:
            problems.append(f"num_key_value_heads {kv} is not divisible by tp {tp}")
        if kv < tp and tp % kv:
            problems.append(f"tp {tp} is not a multiple of num_key_value_heads {kv} "
                            "(KV heads are duplicated across ranks)")
        if kv < tp and not tp % kv and heads % tp:
            problems.append(f"num_attention_heads {heads} is not divisible by tp {tp} "
                            "(ranks sharing a duplicated KV head split its query heads)")
        if even and cfg.intermediate_size % tp:
            problems.append(f"intermediate_size {cfg.intermediate_size} is not divisible by tp {tp}")
        if not even and cfg.intermediate_size < tp:
            problems.append(f"intermediate_size {cfg.intermediate_size} is smaller than tp {tp}")
        if pp > cfg.num_layers:
            problems.append(f"pp {pp} exceeds the number of layers {cfg.num_layers}")
    if problems:
        raise UnsupportedError("cannot shard this model: " + "; ".join(problems) + ". Choose another tp/pp.")


def rank_shard(cfg: ModelConfig, tp: int, rank: int) -> RankShard:
    """What rank `rank` of a tp-way split holds (the split must pass `check_parallelism(even=False)`)."""
    if not 0 <= rank < tp:
        raise UnsupportedError(f"rank {rank} is outside a tensor-parallel group of {tp}.")
    kv, group = cfg.num_kv_heads, cfg.group_size
    if kv >= tp:
        kv_heads = _block(kv, tp, rank)
        q_heads = range(kv_heads.start * group, kv_heads.stop * group)
    else:  # duplicated: tp // kv consecutive ranks hold one KV head and split its query heads
        share = tp // kv
        kv_heads = range(rank // share, rank // share + 1)
        q_heads = _block(cfg.num_heads, tp, rank)
    per_rank = ceil_div(cfg.vocab_size, tp)
    vocab = range(min(rank * per_rank, cfg.vocab_size), min((rank + 1) * per_rank, cfg.vocab_size))
    return RankShard(tp, rank, q_heads, kv_heads, _block(cfg.intermediate_size, tp, rank), vocab, per_rank)


def slice_kv_scales(scales, shard: RankShard):
    """A rank's static KV scales, one entry per layer (None where the layer's format is dynamic):
    per_tensor [] as is, per_head [kv_heads] -> its heads."""
    if scales is None:
        return None
    heads = slice(shard.kv_heads.start, shard.kv_heads.stop)
    return [s[heads].contiguous() if s is not None and s.dim() == 1 else s for s in scales]


# HF tensor name suffix -> (the dim that is split, the shard range it takes; heads count head_dim rows)
_SPLITS = {
    "self_attn.q_proj.weight": (0, "q_heads"),
    "self_attn.k_proj.weight": (0, "kv_heads"),
    "self_attn.v_proj.weight": (0, "kv_heads"),
    "self_attn.o_proj.weight": (1, "q_heads"),
    "mlp.gate_proj.weight": (0, "intermediate"),
    "mlp.up_proj.weight": (0, "intermediate"),
    "mlp.down_proj.weight": (1, "intermediate"),
}
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


class ShardedWeights:
    """A weight source (runtime.weights) seen by one rank: `get` returns that rank's shard,
    streamed with `get_slice` (a safetensors slice read), so no rank loads the full model."""

    def __init__(self, source, cfg: ModelConfig, shard: RankShard):
        self.source, self.cfg, self.shard = source, cfg, shard
        self.has_lm_head = source.has_lm_head

    def _index_range(self, which: str) -> range:
        r = getattr(self.shard, which)
        scale = self.cfg.head_dim if which.endswith("heads") else 1
        return range(r.start * scale, r.stop * scale)

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        if name in _VOCAB_TENSORS:
            v = self.shard.vocab
            part = self.source.get_slice(name, v, None, dtype, device)
            pad = self.shard.vocab_per_rank - len(v)  # zero rows: their logits are cut after the gather
            return torch.cat([part, part.new_zeros(pad, part.shape[1])]) if pad else part
        split = next((s for suffix, s in _SPLITS.items() if name.endswith(suffix)), None)
        if split is None:  # norms: every rank holds them whole
            return self.source.get(name, dtype, device)
        dim, which = split
        r = self._index_range(which)
        rows, cols = (r, None) if dim == 0 else (None, r)
        return self.source.get_slice(name, rows, cols, dtype, device)
