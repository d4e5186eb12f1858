"""benchmarks/peers.py on the CPU: its fp64 reference, its check, and a whole --smoke run (kvq's decode
kernel under the Triton interpreter). FlashInfer and XQA run on the GPU machine only."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import peers
from runtime.attention import decode_attention


@pytest.fixture(scope="module", params=["bf16", "fp8_e4m3"])
def case_and_cache(request):
    case = peers.PagedCase(peers.Shape.parse("tiny-llama3/tp2:3x40"), 16, "cpu", seed=1)
    cache, scale = case.cache(peers.FORMATS[request.param])
    return case, cache, scale, request.param


def test_reference_equals_the_reference_path_over_the_same_pages(case_and_cache):
    case, cache, _, _ = case_and_cache
    ref = peers.reference_fp64(case, cache)
    # runtime.attention's reference dequantizes in fp32 and attends in fp32: agreement to fp32 rounding
    other = decode_attention(case.q.float(), cache, case.block_tables, case.seq_lens, case.sm_scale).double()
    assert peers.relative_error(other, ref) < 1e-5


def test_one_scale_for_k_and_v_from_both_amax(case_and_cache):
    case, cache, scale, name = case_and_cache
    if name == "bf16":
        assert scale is None and cache.k_scale is None
        return
    amax = max(case.k_src.abs().max().item(), case.v_src.abs().max().item())
    assert scale == pytest.approx(amax / 448, rel=1e-6)
    assert cache.k_scale.item() == cache.v_scale.item() == scale


def test_the_check_fails_wrong_outputs(case_and_cache):
    case, cache, _, name = case_and_cache
    ref = peers.reference_fp64(case, cache)
    tol = peers.TOLERANCE[name]
    good = ref.to(torch.bfloat16)  # only the output rounding: passes
    assert peers.relative_error(good, ref) <= tol
    swapped = ref.clone()
    swapped[[0, 1]] = ref[[1, 0]]  # two sequences' outputs exchanged (a wrong page table)
    assert peers.relative_error(swapped, ref) > 5 * tol  # an error of order 1, far over either tolerance
    unwritten = good.clone()
    unwritten[2, 0, 0] = float("nan")  # one element the kernel never wrote (outputs start NaN-poisoned)
    assert peers.relative_error(unwritten, ref) == float("inf")


def test_tolerances_follow_the_formats():
    assert peers.TOLERANCE["bf16"] == 2 * 2.0**-8  # twice bf16's unit roundoff
    assert peers.TOLERANCE["fp8_e4m3"] == 2 * 2.0**-4  # twice e4m3's


def test_smoke_run_writes_rows_and_table(tmp_path):
    assert peers.main(["--smoke", "--out", str(tmp_path), "--shapes", "tiny-llama3/tp2:2x48"]) == 0
    rows = [json.loads(x) for x in (tmp_path / "peers.jsonl").read_text().splitlines()]
    assert rows[0]["kind"] == "env" and rows[0]["impls"] == ["kvq"]
    decode = rows[1:]
    assert [(r["format"], r["impl"]) for r in decode] == [("bf16", "kvq"), ("fp8_e4m3", "kvq")]
    for r in decode:
        assert r["ok"] and 0 < r["relerr"] <= r["tolerance"]
        # K and V x 2 sequences x 48 tokens x 1 KV head x 16 channels, 2 bytes each in bf16, 1 in fp8
        assert r["kv_bytes"] == 2 * 2 * 48 * 16 * {"bf16": 2, "fp8_e4m3": 1}[r["format"]]
    md = (tmp_path / "peers.md").read_text()
    assert "| tiny-llama3 TP2 | 2x48 | fp8_e4m3 |" in md
    assert not (tmp_path / "peers.jsonl.tmp").exists()


def test_shape_errors_name_the_fix():
    with pytest.raises(SystemExit, match="MODEL\\[/tpN\\]:BATCHxCONTEXT"):
        peers.Shape.parse("llama3-8b-16x32768")
    with pytest.raises(SystemExit, match="do not split over TP 16"):
        peers.Shape.parse("llama3-8b/tp16:1x16")


def test_a_peer_that_cannot_run_fails_the_run_but_keeps_the_others(tmp_path):
    # flashinfer is not installed for the CPU tests (it runs on the GPU machine): its rows say why
    assert peers.main(["--smoke", "--out", str(tmp_path), "--shapes", "tiny-llama3/tp2:1x32", "--formats", "bf16",
                       "--impls", "kvq,flashinfer"]) == 1
    rows = [json.loads(x) for x in (tmp_path / "peers.jsonl").read_text().splitlines()][1:]
    by_impl = {r["impl"]: r for r in rows}
    assert by_impl["kvq"]["ok"] and "error" not in by_impl["kvq"]
    assert not by_impl["flashinfer"]["ok"] and by_impl["flashinfer"]["error"]
    assert "| failed |" in (tmp_path / "peers.md").read_text()
