"""CPU lanes (runtime/cpu_lanes.py): a weight split along its outputs multiplies to the unsplit weight's bits."""

from __future__ import annotations

import threading

import pytest
import torch

from runtime import batch_invariant as bi
from runtime import cpu_lanes

pytestmark = pytest.mark.skipif(not bi._packs("cpu", torch.float32), reason="this torch build has no oneDNN linear")
needs_lanes = pytest.mark.skipif(cpu_lanes._omp_set_num_threads() is None, reason="torch does not run on GNU OpenMP")

# SmolLM2's decode shapes (QKV, O, gate/up, down) and an odd one whose slices are uneven
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (101, 67)]
ROWS = (1, 2, 3, 8, 64, 65, 300, 2048)


@pytest.fixture
def threads():
    """torch's thread count, restored after the test."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("parts", [2, 3])
@pytest.mark.parametrize("n,k", SHAPES)
def test_split_product_is_the_unsplit_products_bits(n, k, parts, threads):
    w = _weight(n, k)
    whole, split = bi._pack(w), cpu_lanes.SplitWeight(w, parts, bi._pack)
    gen = torch.Generator().manual_seed(1)
    for t in (1, 2):  # the lanes' one-thread teams and torch's own two-thread one agree too
        threads(t)
        for m in ROWS:
            x = torch.randn(m, k, generator=gen)
            got, want = bi.fast_linear(x, split), bi._onednn_linear(x, whole)
            assert torch.equal(got, want), f"{n}x{k} in {parts} parts, {m} rows, {t} threads: max diff " \
                                           f"{(got - want).abs().max().item():.3g}"
    # and both are the product itself (fp64 reference, fp32 rounding of a k-long sum)
    x = torch.randn(5, k, generator=gen)
    ref = x.double() @ w.double().T
    assert torch.allclose(bi.fast_linear(x, split).double(), ref, rtol=0, atol=k * 2e-6 * ref.abs().max().item())


def test_split_weight_reads_like_the_packed_weight():
    w = _weight(97, 40)
    split = cpu_lanes.SplitWeight(w, 2, bi._pack)
    assert split.shape == w.shape and split.dtype == w.dtype and split.device == w.device
    assert split.numel() * split.element_size() == w.numel() * w.element_size() and split.dim() == 2
    assert split.is_mkldnn and [p.shape[0] for p in split.parts] == [48, 49]
    assert torch.equal(split.to_dense(), w)


@needs_lanes
def test_decode_rows_run_on_the_lanes_prefill_rows_do_not(threads):
    threads(2)
    w = _weight(576, 576)
    split = cpu_lanes.SplitWeight(w, 2, bi._pack)
    lane = cpu_lanes.lanes(1)[0]
    before = lane.products
    bi.fast_linear(torch.randn(8, 576), split)
    assert lane.products == before + 1, "a decode product's second slice must run on the lane thread"
    bi.fast_linear(torch.randn(cpu_lanes.LANE_ROWS + 1, 576), split)
    threads(1)  # fewer threads than slices: the slices run here, one after the other
    bi.fast_linear(torch.randn(8, 576), split)
    assert lane.products == before + 1


@needs_lanes
def test_a_failing_slice_raises_and_leaves_the_lanes_usable(threads):
    threads(2)
    split = cpu_lanes.SplitWeight(_weight(64, 32), 2, bi._pack)
    with pytest.raises(RuntimeError):
        bi.fast_linear(torch.randn(4, 31), split)  # K mismatch: both slices fail
    x = torch.randn(4, 32)
    assert torch.equal(bi.fast_linear(x, split), bi._onednn_linear(x, bi._pack(_weight(64, 32))))


@needs_lanes
def test_two_threads_multiplying_at_once_get_their_own_products(threads):
    threads(2)
    ws = [_weight(384, 96, seed) for seed in (2, 3)]
    splits = [cpu_lanes.SplitWeight(w, 2, bi._pack) for w in ws]
    xs = [torch.randn(3, 96, generator=torch.Generator().manual_seed(s)) for s in (4, 5)]
    want = [bi._onednn_linear(x, bi._pack(w)) for x, w in zip(xs, ws)]
    bad = []

    def worker(i):
        for _ in range(200):
            if not torch.equal(bi.fast_linear(xs[i], splits[i]), want[i]):
                bad.append(i)

    ts = [threading.Thread(target=worker, args=(i,)) for i in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not bad


def test_pack_weight_splits_over_the_threads(threads):
    threads(2)
    packed = bi.pack_weight(_weight(960, 576))
    if cpu_lanes.lanes_available() == 2:
        assert isinstance(packed, cpu_lanes.SplitWeight) and len(packed.parts) == 2
    threads(1)
    assert not isinstance(bi.pack_weight(_weight(960, 576)), cpu_lanes.SplitWeight)


@needs_lanes
def test_a_forked_child_starts_its_own_lanes(threads):
    import multiprocessing as mp

    threads(2)
    split = cpu_lanes.SplitWeight(_weight(64, 32), 2, bi._pack)
    x = torch.randn(4, 32)
    want = bi.fast_linear(x, split)  # the parent's lane exists now
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        got = pool.apply_async(_product_in_child, (x, split.to_dense())).get(timeout=60)
    assert torch.equal(got, want)


def _product_in_child(x, w):
    # the parent's OpenMP workers do not exist in the child either: this thread must not start a team
    # (a GNU OpenMP limit, lanes or not), so the packing runs on one thread
    torch.set_num_threads(1)
    split = cpu_lanes.SplitWeight(w, 2, bi._pack)
    torch.set_num_threads(2)
    got = bi.fast_linear(x, split)
    assert cpu_lanes.lanes(1)[0].products == 1, "the child's own lane must have multiplied the second slice"
    return got


def test_the_switch_turns_the_split_off(threads, monkeypatch):
    threads(2)
    monkeypatch.setenv("KVQ_CPU_LANES", "0")
    assert cpu_lanes.lanes_available() == 1
    assert not isinstance(bi.pack_weight(_weight(960, 576)), cpu_lanes.SplitWeight)
