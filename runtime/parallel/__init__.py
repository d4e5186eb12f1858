"""Tensor parallelism for the embedded engine over torch.distributed (gloo on CPU, NCCL on CUDA).

sharding   what each rank holds (also the TensorRT-LLM checkpoint writer's split rule)
group      the process group: spawned by the engine, or torchrun's
tp_model   one rank of the Llama decoder: sharded weights, collectives
tp_runner  rank 0 broadcasts each step's batch, every rank runs it
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..weights import open_weights
from .group import TPGroup, close_group, join
from .sharding import RankShard, check_parallelism, rank_shard, slice_kv_scales
from .tp_model import TPLlamaModel
from .tp_runner import TPModelRunner

__all__ = ["RankShard", "TPGroup", "TPLlamaModel", "TPModelRunner", "check_parallelism", "close_group", "load_rank",
           "rank_shard", "slice_kv_scales"]


def load_rank(cfg: ModelConfig, path: Path, device: torch.device, dtype: torch.dtype, tp: int,
              engine_args: dict, build) -> TPLlamaModel:
    """This process's rank of a tp-way model, joining (or starting) the group first; the other
    ranks build their engines with `build(path, **engine_args)` (Engine.from_dir)."""
    check_parallelism(cfg, tp, even=False)  # before any process starts
    group = join(tp, device, str(path), engine_args, build)
    try:
        return TPLlamaModel(cfg, open_weights(path, cfg), group, dtype)
    except BaseException:
        group.close(abort=True)
        raise
