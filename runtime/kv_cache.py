"""Paged KV pool tensors: one `LayerCache` per decoder layer.

Layout (shared by the reference path and the Triton kernels):

    k, v          [num_blocks, kv_heads, block_size, stored_head_dim]  fmt.k / fmt.v storage_dtype
                  (K and V may differ: "K8V4" stores int8 K and packed int4 V)
    k_scale, ...  static formats:  per_tensor -> [] fp32, per_head -> [kv_heads] fp32
                  dynamic formats: [num_blocks, kv_heads, block_size]   fmt.scale_torch_dtype
                  group scales:    [num_blocks, kv_heads, block_size, head_dim / group_size]
    k_zero, v_zero  asymmetric per_token only, same shape/dtype as that tensor's scales
    per-channel keys (k.int4-per_channel-asym+...): k_scale, k_zero [num_blocks, kv_heads, head_dim] fp16, one
                  per channel of a complete block; k_residual [slots, kv_heads, block_size, head_dim] fp16 holds
                  the keys of blocks still being written (`residual` maps block -> slot; runtime/channel_keys.py)

A token's slot is `block_id * block_size + offset`. Block ids come from the
torch-free BlockManager; pages of one sequence may be anywhere in the pool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .errors import UnsupportedError
from .kv_format import PER_CHANNEL_TOKENS, KVFormat


class ResidualSlots:
    """Which fp16 residual block holds the keys of which paged block, for blocks whose keys are still being
    written (per-channel keys): one per sequence. A block takes a slot when its first token is written and gives
    it back at the write after its last one (that step's queries still read it), or when the block is freed. A
    chunk that completes its sequence's open block and opens the next finds no slot free for the new block: its
    keys wait (`defer`) until the next write, which first releases the completed block's slot.

    `slot_of` [num_blocks] int32 on the pool's device mirrors `of_block` (-1: none), for kernels that read a
    block's residual without asking the host (runtime/kernels/decode_channel_keys.py)."""

    def __init__(self, num_slots: int, num_blocks: int = 0, device: torch.device | str = "cpu"):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self.of_block: dict[int, int] = {}
        self.slot_of = torch.full((num_blocks,), -1, dtype=torch.int32, device=device)
        self._completed: list[int] = []
        self.deferred: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # block -> (offsets, fp16 keys)
        self.prepared = None  # (slot_mapping, channel_keys.KeyWrite): a step's write planned before its forward
        # a decode burst's writes, planned before it (channel_keys.kernels_backend's prepare_burst): its steps run
        # on the device with `slot_of` as planned for all of them, and the blocks it gives back keep their device
        # entries until the burst's steps have run (`end_burst`), since its earlier steps still read them
        self._held_clears: list[int] | None = None

    def take(self, block: int, required: bool = True) -> int | None:
        """The block's slot, a free one, or (none free) None where not `required`."""
        if block in self.of_block:
            return self.of_block[block]
        if not self._free:
            if not required:
                return None
            raise UnsupportedError(
                f"all {self.num_slots} fp16 residual blocks of the per-channel-key cache are in use; "
                "build the engine with a larger max_batch_size (it sizes the residual blocks)."
            )
        self.of_block[block] = slot = self._free.pop()
        if block < self.slot_of.numel():
            self.slot_of[block] = slot
        return slot

    def completed(self, block: int) -> None:
        """`block` was quantized in this write: its slot is given back at the next write."""
        self._completed.append(block)

    def start_write(self) -> None:
        for b in self._completed:
            self.release(b)
        self._completed.clear()

    def release(self, block: int) -> None:
        self.deferred.pop(block, None)
        slot = self.of_block.pop(block, None)
        if slot is not None:
            self._free.append(slot)
            if self._held_clears is not None:
                self._held_clears.append(block)
            elif block < self.slot_of.numel():
                self.slot_of[block] = -1

    @property
    def planned_ahead(self) -> bool:
        """Whether writes are planned before they run (inside a decode burst)."""
        return self._held_clears is not None

    def plan_ahead(self) -> None:
        """From now on writes are planned before they run (a decode burst): hold the device map's clears."""
        self._held_clears = []

    def end_burst(self) -> None:
        """The burst's steps are enqueued: clear the device entries of the blocks it gave back (on the pool's
        stream, after those steps), but for blocks that hold a slot again."""
        held, self._held_clears = self._held_clears or [], None
        for block in held:
            if block not in self.of_block and block < self.slot_of.numel():
                self.slot_of[block] = -1


@dataclass
class LayerCache:
    fmt: KVFormat
    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None
    k_zero: torch.Tensor | None = None
    v_zero: torch.Tensor | None = None
    k_residual: torch.Tensor | None = None
    residual: ResidualSlots | None = field(default=None, repr=False)

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
    residual_slots: int = 0,
) -> LayerCache:
    """Allocate one layer's pages. Static formats take their calibrated scales here; per-channel keys their
    `residual_slots` fp16 blocks (kv_format.residual_slots)."""
    # Zeros, not empty: attention masks padded slots with a zero weight, but 0 * NaN
    # (uninitialized fp32, or an fp8 NaN bit pattern) would still poison the output.
    pages = {}
    for which in ("k", "v"):
        side = fmt.side(which)
        shape = (num_blocks, kv_heads, block_size, side.stored_head_dim(head_dim))
        pages[which] = torch.zeros(shape, dtype=side.storage_dtype, device=device)
        if side.per_channel_keys:
            if block_size != PER_CHANNEL_TOKENS or residual_slots < 1:
                raise UnsupportedError(
                    f"{fmt.name} scales each channel over a block of {PER_CHANNEL_TOKENS} keys: it needs "
                    f"block_size {PER_CHANNEL_TOKENS} (got {block_size}) and residual blocks (got {residual_slots})."
                )
            meta = (num_blocks, kv_heads, head_dim)
            pages["k_scale"] = torch.ones(meta, dtype=side.scale_torch_dtype, device=device)
            pages["k_zero"] = torch.zeros(meta, dtype=side.scale_torch_dtype, device=device)
            pages["k_residual"] = torch.zeros((residual_slots, kv_heads, block_size, head_dim), dtype=torch.float16,
                                              device=device)
            pages["residual"] = ResidualSlots(residual_slots, num_blocks, device)
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
