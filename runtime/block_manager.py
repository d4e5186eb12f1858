"""Paged-KV bookkeeping without torch: which pages each sequence owns.

Pages ("blocks") hold `block_size` tokens; a sequence's block table lists its
pages in order, so token `pos` lives in slot
`table[pos // block_size] * block_size + pos % block_size`. Blocks are
reference counted so a fork (parallel sampling, shared prefixes) can share
pages; a shared, partly filled last block is copied on write, and the copy is
returned to the caller, who owns the tensors.

Running out of blocks is not an error here: `OutOfBlocks` tells the scheduler
to preempt someone and retry.

Prefix caching (`prefix_caching=True`): a FULL page whose K/V are written is
registered under a content key -- a hash of its token ids, of the previous
page's key (so the key names the whole prefix) and of a salt naming the KV
format and the model, so pages of another format or model never match. A new
sequence takes references on the longest run of cached pages that starts its
tokens and computes only the rest. When its last owner lets go, a cached page
is not freed but parked in an LRU; allocation takes truly free pages first,
then evicts the least recently used parked page (unregistering it), so cached
prefixes cost nothing until the memory is needed and the scheduler preempts
nobody to keep them. A referenced page is never evicted.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field


class OutOfBlocks(Exception):
    """Not enough free blocks for the request; the scheduler preempts or waits."""


@dataclass
class _SeqBlocks:
    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0
    keys: list[bytes] = field(default_factory=list)  # content keys of its leading full, written pages
    num_reused: int = 0  # leading pages taken from the prefix cache at allocation


@dataclass
class PrefixCacheStats:
    """Counters of the prefix cache; lookups and hits count full pages."""

    lookups: int = 0  # full prompt pages looked up at allocation
    hits: int = 0  # of those, found cached (their K/V reused)
    reused_tokens: int = 0  # tokens whose prefill was skipped (hits x block_size)
    evictions: int = 0  # parked cached pages taken for new data

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


def page_key(prev: bytes, tokens: list[int], salt: bytes) -> bytes:
    """Content key of a full page: its tokens, the key of the page before it, the salt."""
    return hashlib.blake2b(prev + struct.pack(f"<{len(tokens)}q", *tokens), digest_size=16, key=salt[:64]).digest()


@dataclass(frozen=True)
class CopyOnWrite:
    """Copy the first `num_tokens` slots of block `src` into block `dst` before writing."""

    src: int
    dst: int
    num_tokens: int


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, *, prefix_caching: bool = False, salt: str = ""):
        """`salt` names what else the K/V depend on (KV format, model): part of every page key."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self._salt = hashlib.blake2b(salt.encode(), digest_size=32).digest()
        self._free: deque[int] = deque(range(num_blocks))
        self._ref = [0] * num_blocks
        self._seqs: dict[object, _SeqBlocks] = {}
        self._cached: dict[bytes, int] = {}  # content key -> page holding it
        self._key_of: dict[int, bytes] = {}  # registered page -> its key
        self._parked: OrderedDict[int, None] = OrderedDict()  # unreferenced cached pages, oldest first
        self.cache_stats = PrefixCacheStats()
        # called with a block whose last owner let go (the KV pool's per-block state: runtime/channel_keys.py)
        self.on_free: list[Callable[[int], object]] = []

    # ------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Pages an allocation can take: free ones and parked cached ones (evicted on demand)."""
        return len(self._free) + len(self._parked)

    @property
    def num_cached_blocks(self) -> int:
        """Registered pages (referenced or parked)."""
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.num_free_blocks

    def can_append(self, seq_id: object) -> bool:
        s = self._seqs[seq_id]
        needs_new = s.num_tokens % self.block_size == 0 or self._ref[s.blocks[-1]] > 1
        return not needs_new or self.num_free_blocks >= 1

    def _match(self, token_ids: list[int]) -> list[int]:
        """Cached pages that start `token_ids`, longest run first to last; the page holding
        the last token is never matched (its logits must be computed)."""
        if not self.prefix_caching:
            return []
        bs, prev, pages = self.block_size, b"", []
        for i in range((len(token_ids) - 1) // bs):
            prev = page_key(prev, token_ids[i * bs:(i + 1) * bs], self._salt)
            b = self._cached.get(prev)
            if b is None:
                break
            pages.append(b)
        return pages

    def blocks_needed(self, token_ids: list[int]) -> int:
        """Pages of the available pool an allocation of `token_ids` would consume: new pages plus
        reused pages that are parked (reused pages another sequence holds cost nothing)."""
        hits = self._match(token_ids)
        return self.blocks_for(len(token_ids)) - sum(1 for b in hits if self._ref[b] > 0)

    def num_keyed_blocks(self, seq_id: object) -> int:
        """Leading pages of the sequence already keyed (written and full)."""
        return len(self._seqs[seq_id].keys)

    def num_reused_blocks(self, seq_id: object) -> int:
        return self._seqs[seq_id].num_reused

    def is_parked(self, block: int) -> bool:
        return block in self._parked

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
        if self._free:
            b = self._free.popleft()
        else:  # evict the least recently used parked page
            b, _ = self._parked.popitem(last=False)
            del self._cached[self._key_of.pop(b)]
            self.cache_stats.evictions += 1
        assert self._ref[b] == 0, "a free block must have no owners"
        self._ref[b] = 1
        return b

    def _reuse(self, b: int) -> None:
        if self._ref[b] == 0:
            del self._parked[b]
        self._ref[b] += 1

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        assert self._ref[b] >= 0, "block released more often than taken"
        if self._ref[b] == 0:
            for hook in self.on_free:
                hook(b)
            if b in self._key_of:
                self._parked[b] = None  # most recently used last
            else:
                self._free.append(b)

    def allocate(self, seq_id: object, num_tokens: int) -> list[int]:
        """Pages for a new sequence of `num_tokens` tokens (all or nothing), none reused."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        if not self.can_allocate(num_tokens):
            raise OutOfBlocks(f"{self.blocks_for(num_tokens)} blocks needed, {self.num_free_blocks} free")
        s = _SeqBlocks([self._take() for _ in range(self.blocks_for(num_tokens))], num_tokens)
        self._seqs[seq_id] = s
        return list(s.blocks)

    def allocate_prefix(self, seq_id: object, token_ids: list[int]) -> int:
        """Pages for a new sequence of `token_ids`, reusing the longest cached prefix of full
        pages (all or nothing); returns how many leading tokens are cached (a multiple of
        block_size, less than len(token_ids)), i.e. where its prefill starts."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} already has blocks")
        need = self.blocks_needed(token_ids)
        if need > self.num_free_blocks:
            raise OutOfBlocks(f"{need} blocks needed, {self.num_free_blocks} free")
        hits = self._match(token_ids)
        for b in hits:  # reference the hits before taking new pages, so none of them is evicted
            self._reuse(b)
        s = _SeqBlocks(hits + [self._take() for _ in range(self.blocks_for(len(token_ids)) - len(hits))],
                       len(token_ids), [self._key_of[b] for b in hits], len(hits))
        self._seqs[seq_id] = s
        st = self.cache_stats
        st.lookups += (len(token_ids) - 1) // self.block_size if self.prefix_caching else 0
        st.hits += len(hits)
        st.reused_tokens += len(hits) * self.block_size
        return len(hits) * self.block_size

    def mark_computed(self, seq_id: object, token_ids: list[int], num_computed: int) -> None:
        """The first `num_computed` of the sequence's tokens have their K/V written: register
        its full pages among them in the prefix cache (call after the step's forward ran)."""
        if not self.prefix_caching:
            return
        s, bs = self._seqs[seq_id], self.block_size
        for i in range(len(s.keys), num_computed // bs):
            key = page_key(s.keys[-1] if s.keys else b"", token_ids[i * bs:(i + 1) * bs], self._salt)
            s.keys.append(key)
            b = s.blocks[i]
            # the same content computed twice (two requests prefilled together): keep the first copy
            if key not in self._cached and b not in self._key_of:
                self._cached[key] = b
                self._key_of[b] = key

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

    def append_tokens(self, seq_id: object, n: int) -> None:
        """Room for n more tokens, as n `append`s (whose copy-on-write a shared last page takes first), with the
        new pages taken at once: a decode burst's room for every running sequence, without a call a token."""
        s = self._seqs[seq_id]
        if n > 0 and s.blocks and s.num_tokens % self.block_size and self._ref[s.blocks[-1]] > 1:
            self.append(seq_id)
            n -= 1
        new = max(0, self.blocks_for(s.num_tokens + n) - len(s.blocks))
        if new > self.num_free_blocks:
            raise OutOfBlocks(f"sequence {seq_id!r} needs {new} blocks, {self.num_free_blocks} free")
        s.blocks += [self._take() for _ in range(new)]
        s.num_tokens += n

    def fork(self, parent: object, child: object) -> None:
        """The child shares every page of the parent (ref counts go up)."""
        if child in self._seqs:
            raise ValueError(f"sequence {child!r} already has blocks")
        p = self._seqs[parent]
        for b in p.blocks:
            self._ref[b] += 1
        self._seqs[child] = _SeqBlocks(list(p.blocks), p.num_tokens, list(p.keys))

    def free(self, seq_id: object) -> None:
        """Give back a sequence's pages (shared pages stay with their other owners; cached
        pages are parked, its last page first, so eviction takes prefix tails first)."""
        s = self._seqs.pop(seq_id, None)
        if s is None:
            return
        for b in reversed(s.blocks):
            self._release(b)
