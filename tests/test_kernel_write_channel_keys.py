"""The device write of per-channel keys (runtime/kernels/write_channel_keys.py after channel_keys.plan_write)
against the reference write (channel_keys.write_keys, whose rule tests/test_channel_keys.py checks against the
fp64 oracle), byte for byte after every write: prompts with whole and open blocks, a chunk that completes its
open block and defers the next, decode steps across block ends, pages out of order, a NaN key, padding slots;
writes planned from the slot_mapping and planned before the step (`prepare_write`, as ModelRunner.build_batch)."""

from __future__ import annotations

import types

import pytest
import torch
from helpers_channel_keys import BLOCK, FMT, keys
from helpers_kernels import DEV, K

from runtime import attention, channel_keys
from runtime.kv_cache import allocate_layer

TENSORS = ("k", "k_scale", "k_zero", "v", "v_scale", "v_zero", "k_residual")


def _backend():
    kernels = types.SimpleNamespace(name="triton", write_kv=K.write_kv, decode_attention=None,
                                    prefill_context_attention=None)
    return channel_keys.kernels_backend(kernels, attention.reference_backend())


def _writes(seqs: int):
    """(sequence, positions) lists, one a write: prompts, then a chunk beside two decode tokens, then decode."""
    yield [(0, range(0, 150)), (1, range(0, 30)), (2, range(0, 63))]
    yield [(1, range(30, 80)), (2, [63]), (0, [150])]  # seq 1's chunk completes block 0 and finds no slot for block 1
    for step in range(70):
        yield [(0, [151 + step]), (1, [80 + step]), (2, [64 + step])][:seqs]


@pytest.mark.parametrize("kvh,d", [(2, 64), (1, 48)])
def test_device_write_equals_the_reference_write(kvh, d):
    seqs, width = 3, 4
    gen = torch.Generator().manual_seed(d)
    tables = torch.randperm(seqs * width, generator=gen).view(seqs, width)  # pages anywhere
    ks = [keys(10 + i, (230, kvh, d)) for i in range(seqs)]
    ks[2][40, 0, 3] = float("nan")  # one NaN: stored as 0, left out of its channel's scale
    vs = [keys(20 + i, (230, kvh, d)) for i in range(seqs)]
    ref = allocate_layer(FMT, seqs * width, BLOCK, kvh, d, "cpu", residual_slots=seqs)
    dev = allocate_layer(FMT, seqs * width, BLOCK, kvh, d, DEV, residual_slots=seqs)
    backend = _backend()
    deferred = 0
    for n, write in enumerate(_writes(seqs)):
        slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for i, pos in write for p in pos]
        k = torch.cat([ks[i][list(pos)] for i, pos in write])
        v = torch.cat([vs[i][list(pos)] for i, pos in write])
        attention.write_kv(ref, k, v, torch.tensor(slots))
        deferred += len(ref.residual.deferred)
        mapping = torch.tensor(slots + [-1, -1], device=DEV)  # two padding rows, as a CUDA graph's bucket has
        kd, vd = (torch.cat((x, torch.zeros(2, kvh, d))).to(DEV) for x in (k, v))
        if n % 2:
            backend.prepare_write([dev], mapping, slots)
        backend.write_kv(dev, kd, vd, mapping)
        assert ref.residual.of_block == dev.residual.of_block, n
        assert dev.residual.slot_of.tolist()[:seqs * width] == [ref.residual.of_block.get(b, -1)
                                                                for b in range(seqs * width)]
        assert ref.residual.deferred.keys() == dev.residual.deferred.keys(), n
        for name in TENSORS:  # bit for bit, but a NaN's payload (the GPU's conversion to fp16 makes it canonical)
            a, b = getattr(ref, name), getattr(dev, name).cpu()
            torch.testing.assert_close(b, a, rtol=0, atol=0, equal_nan=True, msg=lambda m, n=n, name=name: f"write {n}, {name}: {m}")
    assert deferred, "the chunk deferred no block: the case is not exercised"


def test_a_burst_planned_ahead_writes_and_reads_as_steps_planned_one_by_one():
    """A decode burst's writes planned before it (`prepare_burst`, the device map's clears held to `end_burst`)
    against the same steps each planned before itself: after every step the same cache bytes and the same decode
    output (which reads each sequence's own block from its residual slot through `slot_of`); after the burst the
    same slot map. Sequences cross block ends inside the bursts, one at a burst's first step."""
    kvh, d, seqs, width = 2, 64, 3, 4
    tables = torch.randperm(seqs * width, generator=torch.Generator().manual_seed(3)).view(seqs, width)
    ks = [keys(30 + i, (230, kvh, d)) for i in range(seqs)]
    vs = [keys(40 + i, (230, kvh, d)) for i in range(seqs)]
    q = keys(50, (seqs, 2 * kvh, d)).to(DEV)
    backend = _backend()
    ahead, stepped = (allocate_layer(FMT, seqs * width, BLOCK, kvh, d, DEV, residual_slots=seqs) for _ in range(2))
    lens = [60, 127, 64]  # prompts: seq 1 completes its block at the first decode token, seq 2 opens one
    for cache in (ahead, stepped):
        for i, n in enumerate(lens):
            slots = [int(tables[i, p // BLOCK]) * BLOCK + p % BLOCK for p in range(n)]
            backend.write_kv(cache, ks[i][:n].to(DEV), vs[i][:n].to(DEV), torch.tensor(slots, device=DEV))
    crossed = 0
    for burst in range(3):
        steps = [[int(tables[i, (n + j) // BLOCK]) * BLOCK + (n + j) % BLOCK for i, n in enumerate(lens)]
                 for j in range(8)]
        crossed += sum((n + j) % BLOCK == 0 for n in lens for j in range(8))
        backend.prepare_burst([ahead], steps)
        for j, slots in enumerate(steps):
            mapping = torch.tensor(slots, device=DEV)
            k = torch.stack([ks[i][n + j] for i, n in enumerate(lens)]).to(DEV)
            v = torch.stack([vs[i][n + j] for i, n in enumerate(lens)]).to(DEV)
            backend.write_kv(ahead, k, v, mapping)
            backend.prepare_write([stepped], mapping, slots)
            backend.write_kv(stepped, k, v, mapping)
            seq_lens = torch.tensor([n + j + 1 for n in lens], dtype=torch.int32, device=DEV)
            bt = tables.to(torch.int32).to(DEV)
            outs = [K.decode_attention(q, c, bt, seq_lens, 0.125) for c in (ahead, stepped)]
            assert torch.equal(outs[0], outs[1]), (burst, j)
            for name in TENSORS:
                assert torch.equal(getattr(ahead, name), getattr(stepped, name)), (burst, j, name)
        backend.end_burst([ahead])
        assert ahead.residual.of_block == stepped.residual.of_block
        assert torch.equal(ahead.residual.slot_of, stepped.residual.slot_of), burst
        lens = [n + 8 for n in lens]
    assert crossed >= 3, "no sequence crossed a block end inside a burst"
