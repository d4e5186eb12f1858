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
