"""One tensor-parallel rank of the Llama decoder.

The layer maths is `LlamaModel`'s; this rank loads only its shard
(`sharding.ShardedWeights`), computes its own heads, and joins the ranks' partial
results with three collectives:

* vocabulary-parallel embedding: a rank looks up the ids in its vocabulary block
  (zero rows elsewhere) and the rows are all-reduced (a sum of one value and zeros,
  exact in every dtype);
* row-parallel o and down projections: their partial sums are all-reduced;
* vocabulary-parallel LM head: each rank's logits for its block are all-gathered
  and the padding rows cut off.

All three run on the group's device (gloo on CPU, NCCL on CUDA, where they are
captured into the decode CUDA graphs like every other kernel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..batch_invariant import fast_linear
from ..config import ModelConfig
from ..model import LlamaModel
from .group import TPGroup
from .sharding import ShardedWeights, check_parallelism, rank_shard


class TPLlamaModel(LlamaModel):
    def __init__(self, cfg: ModelConfig, weights, group: TPGroup, dtype: torch.dtype = torch.float32):
        check_parallelism(cfg, group.tp, even=False)
        self.group = group
        self.shard = rank_shard(cfg, group.tp, group.rank)
        super().__init__(cfg, ShardedWeights(weights, cfg, self.shard), group.device, dtype)
        self.num_heads, self.num_kv_heads = len(self.shard.q_heads), len(self.shard.kv_heads)

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group.pg)
        return x

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.device)
        local = ids - self.shard.vocab.start
        mine = (local >= 0) & (local < len(self.shard.vocab))
        h = F.embedding(torch.where(mine, local, 0), self.embed_tokens)
        return self._reduce(h * mine.unsqueeze(-1).to(h.dtype))

    def logits(self, h: torch.Tensor, lin=fast_linear) -> torch.Tensor:
        part = lin(self._rms_norm(h, self.final_norm), self.lm_head).to(torch.float32).contiguous()
        parts = [torch.empty_like(part) for _ in range(self.group.tp)]
        dist.all_gather(parts, part, group=self.group.pg)
        return torch.cat(parts, dim=-1)[..., : self.cfg.vocab_size]
