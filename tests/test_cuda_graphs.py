"""Decode steps through CUDA graphs (runtime/cuda_graphs.py) give the eager step's logits.

The GPU tests run where CUDA exists. A captured step runs the same kernels on the same
shapes as an eager step whose block tables are padded to the engine's longest sequence
and whose batch fills the bucket, so the logits must be bit-identical; rows of a bucket
do not interact, so a partly filled bucket must give the same rows.
"""

from __future__ import annotations

import types

import pytest
import torch
from helpers_runtime import tiny_llama_dir

from runtime.attention import reference_backend
from runtime.config import ModelConfig
from runtime.cuda_graphs import bucket_for, can_capture
from runtime.engine import Engine
from runtime.kv_format import KVFormat
from runtime.kv_quant import static_scale_from_amax
from runtime.model import PagedBatch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
FORMATS = [KVFormat("bf16"), KVFormat("fp8_e4m3", "per_tensor"), KVFormat("int8", "per_token"),
           KVFormat("int4", "per_token", False)]
LENS = [20 + 7 * i for i in range(8)]  # context lengths of the 8 sequences


def test_bucket_sizes():
    # 1, 2, 4, then multiples of 8: every n gets the smallest such size >= n
    sizes = [1, 2, 4] + list(range(8, 129, 8))
    for n in range(1, 129):
        assert bucket_for(n) == min(s for s in sizes if s >= n)


def test_capture_needs_the_kernel_write_and_decode():
    ref = reference_backend()

    def kernel_op(*args):  # stands for a Triton op: anything that is not the reference function
        raise AssertionError("not called")

    assert not can_capture(ref)
    assert not can_capture(types.SimpleNamespace(write_kv=kernel_op, decode_attention=ref.decode_attention))
    assert not can_capture(types.SimpleNamespace(write_kv=ref.write_kv, decode_attention=kernel_op))
    assert can_capture(types.SimpleNamespace(write_kv=kernel_op, decode_attention=kernel_op))


def test_no_graphs_off_cuda(tmp_path_factory):
    eng = Engine.from_dir(tiny_llama_dir(tmp_path_factory), device="cpu", num_blocks=16, block_size=16)
    try:
        assert eng.runner.graphs is None and not eng.stats.cuda_graphs
    finally:
        eng.shutdown()


def _engine(d, fmt: KVFormat) -> Engine:
    cfg = ModelConfig.from_dir(d)
    scales = None
    if fmt.static:
        s = static_scale_from_amax(torch.full((cfg.num_layers,), 6.0), fmt)
        scales = {"k_scale": s, "v_scale": s}
    # the legacy step's graphs: no bursts, which would run every decode step here
    return Engine.from_dir(d, device="cuda", dtype="bfloat16", kv_format=fmt, kv_scales=scales, num_blocks=96,
                           block_size=16, max_batch_size=16, max_seq_len=256, burst_steps=0)


def _prefill(eng: Engine) -> list[list[int]]:
    """Allocate the sequences and write their K/V with one eager prefill step; their block tables."""
    bs, dev = eng.blocks.block_size, eng.model.device
    g = torch.Generator().manual_seed(0)
    tables, ids, pos, slots, cu = [], [], [], [], [0]
    for i, n in enumerate(LENS):
        eng.blocks.allocate(("g", i), n + 1)
        t = eng.blocks.block_table(("g", i))
        tables.append(t)
        ids += torch.randint(3, eng.cfg.vocab_size, (n,), generator=g).tolist()
        pos += list(range(n))
        slots += [t[p // bs] * bs + p % bs for p in range(n)]
        cu.append(cu[-1] + n)

    def tensor(x, dtype):
        return torch.tensor(x, dtype=dtype, device=dev)

    eng.model.forward_paged(PagedBatch(
        tensor(ids, torch.int64), tensor(pos, torch.int64), tensor(slots, torch.int64), 0,
        torch.zeros((0, 1), dtype=torch.int32, device=dev), torch.zeros(0, dtype=torch.int32, device=dev),
        tensor(cu, torch.int32), tensor([c - 1 for c in cu[1:]], torch.int64)), eng.runner.caches, eng.backend)
    return tables


def _decode(eng: Engine, tables: list[list[int]], width: int) -> PagedBatch:
    """A decode step for the first len(tables) sequences, block tables padded to `width`."""
    bs, dev, n = eng.blocks.block_size, eng.model.device, len(tables)
    ids = [(7 * i) % 200 + 3 for i in range(n)]
    return PagedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
        positions=torch.tensor(LENS[:n], dtype=torch.int64, device=dev),
        slot_mapping=torch.tensor([t[p // bs] * bs + p % bs for t, p in zip(tables, LENS)], dtype=torch.int64,
                                  device=dev),
        num_decode=n,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
        seq_lens=torch.tensor([p + 1 for p in LENS[:n]], dtype=torch.int32, device=dev),
        cu_seqlens=torch.zeros(1, dtype=torch.int32, device=dev),
        logits_indices=torch.arange(n, dtype=torch.int64, device=dev),
        max_position=max(LENS[:n]),
    )


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_graph_step_is_the_eager_step(tmp_path_factory, fmt):
    eng = _engine(tiny_llama_dir(tmp_path_factory), fmt)
    try:
        graphs = eng.runner.graphs
        assert graphs is not None and eng.stats.cuda_graphs
        tables = _prefill(eng)
        natural = max(len(t) for t in tables)
        assert natural < graphs.max_blocks  # the graph's tables are wider than this batch's
        eager = eng.model.forward_paged(_decode(eng, tables, graphs.max_blocks), eng.runner.caches, eng.backend)
        full = eng.runner.forward(_decode(eng, tables, natural))  # captures bucket 8, replays it
        assert graphs.failure is None, graphs.failure
        assert list(graphs._graphs) == [8]
        assert torch.isfinite(eager).all()
        assert torch.equal(full, eager)
        # 5 sequences in the same bucket: rows 5-7 now padding, the first 5 rows unchanged
        part = eng.runner.forward(_decode(eng, tables[:5], natural))
        assert list(graphs._graphs) == [8]
        assert torch.equal(part, eager[:5])
        # and the eager path still agrees after the replays (the graph wrote only the decode slots)
        again = eng.model.forward_paged(_decode(eng, tables, graphs.max_blocks), eng.runner.caches, eng.backend)
        assert torch.equal(again, eager)
    finally:
        eng.shutdown()


@gpu
@pytest.mark.gpu
def test_engine_generation_uses_graphs(tmp_path_factory):
    eng = _engine(tiny_llama_dir(tmp_path_factory), KVFormat("int8", "per_token"))
    try:
        prompts = [[(5 * i + 11 * j) % 500 + 3 for j in range(n)] for i, n in enumerate([4, 33, 7, 61, 18])]
        outs = eng.generate(prompts, max_tokens=12, ignore_eos=True)
        assert all(len(o.token_ids) == 12 for o in outs)
        assert eng.runner.graphs.failure is None, eng.runner.graphs.failure
        # the decode steps of 5 running sequences went through bucket 8
        assert 8 in eng.runner.graphs._graphs
    finally:
        eng.shutdown()
