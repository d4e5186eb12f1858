"""Rank 0 schedules, every rank runs the step: the step's `PagedBatch` is broadcast.

Rank 0's engine owns the scheduler, block manager and sampling; its runner
broadcasts each step's batch (block tables, slots, positions, ...) before
running the model, and ranks 1..N-1 run the same `ModelRunner.forward` on it, so
they take the same eager / CUDA-graph decisions and meet rank 0 in every
collective. Nothing but the batch crosses: tokens are sampled on rank 0 and come
back to the other ranks as the next step's input ids.

A batch travels as two broadcasts on the group's device: a fixed-size int64
header (per PagedBatch field: None / int / tensor with dtype and shape) and the
fields' integer tensors concatenated. The header is built from
`dataclasses.fields(PagedBatch)`, so fields added to the batch travel unchanged.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..errors import KvqError
from ..model import PagedBatch
from ..runner import ModelRunner
from .group import release

_FIELDS = [f.name for f in dataclasses.fields(PagedBatch)]
_DTYPES = [torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
_NONE, _INT, _TENSOR = 0, 1, 2
_MAX_DIMS = 2
_SLOT = 3 + _MAX_DIMS  # kind, value/dtype, ndim, dims...
_STEP, _STOP = 1, 0


def _header(batch: PagedBatch | None, device: torch.device) -> tuple[torch.Tensor, list[torch.Tensor]]:
    head = [_STOP if batch is None else _STEP] + [0] * (_SLOT * len(_FIELDS))
    tensors = []
    for i, name in enumerate(_FIELDS if batch is not None else []):
        v, at = getattr(batch, name), 1 + _SLOT * i
        if v is None:
            continue
        if isinstance(v, torch.Tensor):
            if v.dtype not in _DTYPES or v.dim() > _MAX_DIMS:
                raise KvqError(f"PagedBatch.{name} ({v.dtype}, {v.dim()} dims) cannot be broadcast to the "
                               "tensor-parallel ranks; extend runtime/parallel/tp_runner.py.")
            head[at:at + 3 + v.dim()] = [_TENSOR, _DTYPES.index(v.dtype), v.dim(), *v.shape]
            tensors.append(v)
        else:
            head[at:at + 2] = [_INT, int(v)]
    return torch.tensor(head, dtype=torch.int64).to(device), tensors


def send_batch(batch: PagedBatch | None, pg, device: torch.device) -> None:
    """Rank 0: the step's batch (None: stop) to every other rank."""
    head, tensors = _header(batch, device)
    dist.broadcast(head, 0, group=pg)
    if tensors:
        flat = torch.cat([t.to(device=device, dtype=torch.int64).reshape(-1) for t in tensors])
        dist.broadcast(flat, 0, group=pg)


def recv_batch(pg, device: torch.device) -> PagedBatch | None:
    """Ranks 1..N-1: the next step's batch, or None when rank 0 stops."""
    head = torch.empty(1 + _SLOT * len(_FIELDS), dtype=torch.int64, device=device)
    dist.broadcast(head, 0, group=pg)
    h = head.tolist()
    if h[0] == _STOP:
        return None
    shapes = []
    for i in range(len(_FIELDS)):
        kind, value, ndim, *dims = h[1 + _SLOT * i: 1 + _SLOT * (i + 1)]
        shapes.append((kind, value, tuple(dims[:ndim])))
    sizes = [torch.Size(s).numel() for kind, _, s in shapes if kind == _TENSOR]
    flat = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    if sizes:
        dist.broadcast(flat, 0, group=pg)
    parts = iter(flat.split(sizes))
    values = {}
    for name, (kind, value, shape) in zip(_FIELDS, shapes):
        if kind == _TENSOR:
            values[name] = next(parts).view(shape).to(_DTYPES[value])
        elif kind == _INT:
            values[name] = value
        else:
            values[name] = None
    return PagedBatch(**values)


class TPModelRunner(ModelRunner):
    """A ModelRunner whose forward passes run on every rank of `model.group`."""

    def forward(self, batch: PagedBatch) -> torch.Tensor:
        group = self.model.group
        if group.is_driver:
            send_batch(batch, group.pg, group.device)
        return super().forward(batch)

    def serve(self) -> None:
        """Ranks 1..N-1: run rank 0's steps until it stops."""
        group = self.model.group
        while (batch := recv_batch(group.pg, group.device)) is not None:
            super().forward(batch)

    def close(self) -> None:
        group = self.model.group
        if getattr(self, "_closed", False):
            return
        self._closed = True
        if group.is_driver:
            send_batch(None, group.pg, group.device)
        release(group)
