"""Paged-KV bookkeeping without torch: which pages each sequence owns.

Pages ("blocks") hold `block_size` tokens; a sequence's block table lists its
pages in order, so token `pos` lives in slot
`table[pos // block_size] * block_size + pos % block_size`. Blocks are
reference counted so a fork (parallel sampling, shared prefixes) can share
pages; a shared, partly filled last block is copied on write, and the copy is
returned to the caller, who owns the tensors.

Running out of blocks is not an error here: `OutOfBlocks` tells the scheduler
to preempt someone and retry.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


class OutOfBlocks(Exception):
    """Not enough free blocks for the request; the scheduler preempts or waits."""


@dataclass
class _SeqBlocks:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(frozen=True)
class CopyOnWrite:
    """Copy the first `num_tokens` slots of block `src` into block `dst` before writing."""

    src: int
    dst: int
    num_tokens: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._seqs: dict[object, _SeqBlocks] = {}

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= len(self._free)

    def can_append(self, seq_id: object) -> bool:
        s = self._seqs[seq_id]
        needs_new = s.num_tokens % self.block_size == 0 or self._ref[s.blocks[-1]] > 1
        return not needs_new or len(self._free) >= 1

    def block_table(self, seq_id: object) -> list[int]:
        return list(self._seqs[seq_id].blocks)

    def num_tokens(self, seq_id: object) -> int:
        return self._seqs[seq_id].num_tokens

    def slot(self, seq_id: object, pos: int) -> int:
        s = self._seqs[seq_id]
        if not 0 <= pos < s.num_tokens:
            raise IndexError(f"position {pos} outside the {s.num_tokens} tokens of sequence {seq_id!r}")
        return s.blocks[pos // self.block_size] * self.block_size + pos % self.block_size

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._seqs

    # ---------------------------------------------------------- mutations
    def _take(self) -> int:
        b = self._free.popleft()
        assert self._ref[b] == 0, "a free block must have no owners"
        self._ref[b] = 1
        return b

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        assert self._ref[b] >= 0, "block released more often than taken"
        if self._ref[b] == 0:
            self._free.append(b)

    def allocate(self, seq_id: object, num_tokens: int) -> list[int]:
        """Pages for a new sequence of `num_tokens` tokens (all or nothing)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not self.can_allocate(num_tokens):
            raise OutOfBlocks(f"{self.blocks_for(num_tokens)} blocks needed, {len(self._free)} free")
        s = _SeqBlocks([self._take() for _ in range(self.blocks_for(num_tokens))], num_tokens)
        self._seqs[seq_id] = s
        return list(s.blocks)

    def append(self, seq_id: object) -> CopyOnWrite | None:
        """Room for one more token; a new page when the last one is full (or shared)."""
        s = self._seqs[seq_id]
        if not self.can_append(seq_id):
            raise OutOfBlocks(f"sequence {seq_id!r} needs a block, none free")
        cow = None
        offset = s.num_tokens % self.block_size
        if offset == 0:
            s.blocks.append(self._take())
        elif self._ref[s.blocks[-1]] > 1:
            old = s.blocks[-1]
            s.blocks[-1] = self._take()
            self._release(old)
            cow = CopyOnWrite(old, s.blocks[-1], offset)
        s.num_tokens += 1
        return cow

    def fork(self, parent: object, child: object) -> None:
        """The child shares every page of the parent (ref counts go up)."""
        if child in self._seqs:
            raise ValueError(f"sequence {child!r} already has blocks")
        p = self._seqs[parent]
        for b in p.blocks:
            self._ref[b] += 1
        self._seqs[child] = _SeqBlocks(list(p.blocks), p.num_tokens)

    def free(self, seq_id: object) -> None:
        """Give back a sequence's pages (shared pages stay with their other owners)."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return
        for b in reversed(s.blocks):
            self._release(b)
