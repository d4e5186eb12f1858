"""Paged KV pool tensors: one `LayerCache` per decoder layer.

Layout (shared by the reference path and the Triton kernels):

    k, v          [num_blocks, kv_heads, block_size, stored_head_dim]  fmt.k / fmt.v storage_dtype
                  (K and V may differ: "K8V4" stores int8 K and packed int4 V)
    k_scale, ...  static formats:  per_tensor -> [] fp32, per_head -> [kv_heads] fp32
                  dynamic formats: [num_blocks, kv_heads, block_size]   fmt.scale_torch_dtype
                  group scales:    [num_blocks, kv_heads, block_size, head_dim / group_size]
    k_zero, v_zero  asymmetric per_token only, same shape/dtype as that tensor's scales

A token's slot is `block_id * block_size + offset`. Block ids come from the
torch-free BlockManager; pages of one sequence may be anywhere in the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kv_format import KVFormat


@dataclass
class LayerCache:
    fmt: KVFormat
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]


def allocate_layer(
    fmt: KVFormat,
    num_blocks: int,
    block_size: int,
    kv_heads: int,
    head_dim: int,
    device: torch.device | str,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> LayerCache:
    """Allocate one layer's pages. Static formats take their calibrated scales here."""
    # Zeros, not empty: attention masks padded slots with a zero weight, but 0 * NaN
    # (uninitialized fp32, or an fp8 NaN bit pattern) would still poison the output.
    pages = {}
    for which in ("k", "v"):
        side = fmt.side(which)
        shape = (num_blocks, kv_heads, block_size, side.stored_head_dim(head_dim))
        pages[which] = torch.zeros(shape, dtype=side.storage_dtype, device=device)
        if side.dynamic:
            meta = side.meta_shape(num_blocks, kv_heads, block_size, head_dim)
            pages[f"{which}_scale"] = torch.ones(meta, dtype=side.scale_torch_dtype, device=device)
            if not side.symmetric:
                pages[f"{which}_zero"] = torch.zeros(meta, dtype=side.scale_torch_dtype, device=device)
    if fmt.static:
        if k_scale is None or v_scale is None:
            raise ValueError(f"{fmt.name} needs calibrated k/v scales")
        pages["k_scale"] = k_scale.to(device=device, dtype=torch.float32)
        pages["v_scale"] = v_scale.to(device=device, dtype=torch.float32)
    return LayerCache(fmt, **pages)
