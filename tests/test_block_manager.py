"""The torch-free block manager on its own: free list, ref counts, out-of-blocks."""

from __future__ import annotations

import random

import pytest

from runtime.block_manager import BlockManager, CopyOnWrite, OutOfBlocks


def test_module_does_not_import_torch():
    import runtime.block_manager as bm

    assert "torch" not in bm.__dict__
    with open(bm.__file__) as f:
        src = f.read()
    assert "import torch" not in src


def test_allocate_append_free_and_slots():
    m = BlockManager(num_blocks=4, block_size=4)
    assert m.allocate("a", 5) == [0, 1]  # 5 tokens -> 2 blocks
    assert m.num_free_blocks == 2
    assert [m.slot("a", p) for p in range(5)] == [0, 1, 2, 3, 4]
    for _ in range(3):  # fill the second block (tokens 5..7)
        assert m.append("a") is None
    assert m.num_free_blocks == 2 and m.num_tokens("a") == 8
    m.append("a")  # token 8 starts a third block
    assert m.block_table("a") == [0, 1, 2] and m.slot("a", 8) == 8
    m.free("a")
    assert m.num_free_blocks == 4 and "a" not in m
    m.allocate("b", 3)
    with pytest.raises(IndexError):
        m.slot("b", 3)  # beyond the sequence's tokens


def test_out_of_blocks_is_all_or_nothing():
    m = BlockManager(num_blocks=3, block_size=2)
    m.allocate("a", 4)
    assert not m.can_allocate(3)
    with pytest.raises(OutOfBlocks):
        m.allocate("b", 3)
    assert m.num_free_blocks == 1 and "b" not in m  # nothing leaked
    m.allocate("b", 1)
    m.append("b")  # fills b's block
    assert not m.can_append("b")
    with pytest.raises(OutOfBlocks):
        m.append("b")
    assert m.num_tokens("b") == 2
    m.free("a")
    assert m.can_append("b")


def test_freed_blocks_are_reused_and_pages_out_of_order():
    m = BlockManager(num_blocks=6, block_size=2)
    m.allocate("a", 2)
    m.allocate("b", 2)
    m.allocate("c", 2)
    m.free("b")
    m.allocate("d", 8)  # gets the three free tail blocks and b's old block last
    assert sorted(m.block_table("d")) == [1, 3, 4, 5]
    assert m.slot("d", 7) == m.block_table("d")[3] * 2 + 1


def test_fork_shares_blocks_and_copies_partial_last_block_on_write():
    m = BlockManager(num_blocks=8, block_size=4)
    m.allocate("p", 6)  # blocks [0, 1], block 1 half full
    m.fork("p", "c")
    assert m.block_table("c") == [0, 1] and m.ref_count(0) == 2 and m.ref_count(1) == 2
    cow = m.append("c")
    assert cow == CopyOnWrite(src=1, dst=cow.dst, num_tokens=2) and cow.dst not in (0, 1)
    assert m.block_table("c") == [0, cow.dst] and m.ref_count(1) == 1
    m.free("p")
    assert m.ref_count(0) == 1  # still owned by the child
    assert m.num_free_blocks == 8 - 2
    m.free("c")
    assert m.num_free_blocks == 8


def test_random_workload_never_leaks_or_double_books():
    rng = random.Random(0)
    m = BlockManager(num_blocks=32, block_size=4)
    live: dict[int, int] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.3:
            n = rng.randint(1, 20)
            if m.can_allocate(n):
                m.allocate(step, n)
                live[step] = n
        elif op < 0.8 and live:
            s = rng.choice(list(live))
            if m.can_append(s):
                m.append(s)
                live[s] += 1
        elif live:
            m.free(live.popitem()[0] if rng.random() < 0.5 else next(iter(live)))
            live = {k: v for k, v in live.items() if k in m}
        owned = [b for s in live for b in m.block_table(s)]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert len(owned) + m.num_free_blocks == 32, "blocks leaked"
        for s, n in live.items():
            assert m.num_tokens(s) == n and len(m.block_table(s)) == -(-n // 4)


def test_invalid_construction():
    with pytest.raises(ValueError):
        BlockManager(0, 16)


def test_append_tokens_is_n_appends():
    """A burst's room at once (append_tokens) leaves the pages, tokens and reference counts of n appends, shared
    last pages (forks) and full pages included; and is all or nothing when the pool runs out."""
    rng = random.Random(1)
    one, many = BlockManager(num_blocks=64, block_size=4), BlockManager(num_blocks=64, block_size=4)
    live: list[int] = []
    for step in range(1500):
        op = rng.random()
        if op < 0.2:
            n = rng.randint(1, 12)
            if one.can_allocate(n):
                for m in (one, many):
                    m.allocate(step, n)
                live.append(step)
        elif op < 0.3 and live:
            parent = rng.choice(live)
            if one.num_free_blocks:
                for m in (one, many):
                    m.fork(parent, step)
                live.append(step)
        elif op < 0.85 and live:
            s, n = rng.choice(live), rng.randint(0, 9)
            want = one.num_tokens(s) + n
            if one.blocks_for(want) - len(one.block_table(s)) + 1 <= one.num_free_blocks:
                for _ in range(n):
                    one.append(s)
                many.append_tokens(s, n)
                assert many.num_tokens(s) == want
        elif live:
            s = live.pop(rng.randrange(len(live)))
            for m in (one, many):
                m.free(s)
        assert {s: one.block_table(s) for s in live} == {s: many.block_table(s) for s in live}
        assert one.num_free_blocks == many.num_free_blocks
        assert all(one.ref_count(b) == many.ref_count(b) for s in live for b in one.block_table(s))
    m = BlockManager(num_blocks=3, block_size=4)
    m.allocate("a", 4)
    with pytest.raises(OutOfBlocks):
        m.append_tokens("a", 9)  # three more pages, two free
    assert m.num_tokens("a") == 4 and m.block_table("a") == [0] and m.num_free_blocks == 2
