"""Which ops an engine runs: the attention backend for its device and formats, the batch-invariant mode's
ops (its own Triton kernels on CUDA, torch's elsewhere) and the fused small ops of a CUDA decode step."""

from __future__ import annotations

import types

from . import batch_invariant, parallel
from .attention import select_backend
from .errors import InputError, UnsupportedError
from .kv_format import KVFormat
from .model import LlamaModel


def engine_backend(model: LlamaModel, formats: tuple[KVFormat, ...], attention: str, invariant: bool,
                   fused_ops: bool):
    """The ops namespace an Engine hands its model: `attention` ('auto' / 'reference' / 'triton') for the
    device, replaced by the batch-invariant mode's ops when `invariant`, plus the fused small ops."""
    backend = select_backend(model.device, formats, attention)  # also checks `attention` for the device
    if invariant:
        if attention == "triton":
            raise InputError("the batch-invariant mode runs its own attention ops; pass attention='auto' "
                             "or batch_invariant=False to use the Triton kernels.")
        backend = batch_invariant_backend(model)
    if fused_ops:
        backend = with_small_ops(backend, model, invariant)
    return backend


def batch_invariant_backend(model: LlamaModel):
    """The mode's ops: on CUDA its Triton kernels (runtime/kernels/invariant_attention.py), elsewhere torch's, after
    measuring that this machine's GEMMs allow it (UnsupportedError if not)."""
    if model.device.type == "cuda":
        if isinstance(model, parallel.TPLlamaModel):
            # its kernels' norms are fused with the residual adds, where a tensor-parallel model all-reduces
            raise UnsupportedError("the batch-invariant mode on CUDA runs on one device; build the engine with tp: 1, "
                                   "or with build.batch_invariant: false for tensor parallelism.")
        from .kernels import invariant_attention

        return invariant_attention.backend()
    layer = model.layer(0)
    rotation = [model.rotation_weight] if model.rotation_weight is not None else []
    batch_invariant.check([layer.qkv, layer.o, layer.gate_up, layer.down, model.lm_head, *rotation],
                          model.cfg.head_dim)
    return batch_invariant.backend()


def with_small_ops(backend, model: LlamaModel, batch_invariant: bool):
    """`backend` plus the fused small ops (runtime/kernels/small_ops.py), which LlamaModel.forward_paged
    then runs in place of its torch norms, RoPE and SwiGLU, and the skinny-matmul rule
    (runtime/kernels/skinny_gemm.py)."""
    if model.device.type != "cuda":
        raise InputError("fused_ops=True runs Triton kernels and needs a CUDA device; leave it False on the CPU.")
    if batch_invariant:
        raise InputError("the batch-invariant mode keeps its own ops; pass fused_ops=False with batch_invariant=True.")
    from .kernels import skinny_gemm, small_ops

    # the skinny-matmul rule too: cuBLAS unless the GPU's tuned data says the GEMV wins at that shape
    return types.SimpleNamespace(**dict(vars(backend), name=backend.name + "+small_ops", small_ops=small_ops,
                                        linear=skinny_gemm.linear))
