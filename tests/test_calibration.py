"""Calibration: corpus, statistics, scale policies, the stage outputs, and bad input.

Fast tests use a tiny random Llama with SmolLM2's real tokenizer; the real
SmolLM2 checks live in test_calibration_smollm2.py (slow).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import helpers_calibration as H  # noqa: E402

from calibration import corpus  # noqa: E402
from calibration.calibrate import layer_amax, run_calibration, scales_for  # noqa: E402
from calibration.policies import choose_clip, pooled, scales_from_stats, static_formats  # noqa: E402
from calibration.stats import BINS_PER_OCTAVE, LOG2_LO, KVStats  # noqa: E402
from runtime.errors import InputError, NumericsError  # noqa: E402
from runtime.kv_format import KVFormat  # noqa: E402
from runtime.kv_quant import (
    dequantize,
    quantize,  # noqa: E402
)

QMAX = {"fp8_e4m3": 448.0, "fp8_e5m2": 57344.0, "int8": 127.0, "int4": 7.0}  # the design's table


# ------------------------------------------------------------------ corpus
def test_builtin_corpus_is_prose_split_without_overlap():
    cal, ev = corpus.builtin_documents("calibration"), corpus.builtin_documents("evaluation")
    assert len(cal) > 1000 and len(ev) > 100
    assert not {d.text for d in cal} & {d.text for d in ev}
    for d in cal[:500] + ev[:100]:
        assert ">>>" not in d.text and len(d.text.split()) >= 8 and "\n" not in d.text


def test_token_windows_deterministic_by_seed():
    tok = H.load_tokenizer_fast()
    docs = corpus.builtin_documents("calibration")
    a = corpus.token_windows(tok, docs, 4, 64, seed=3)
    b = corpus.token_windows(tok, docs, 4, 64, seed=3)
    c = corpus.token_windows(tok, docs, 4, 64, seed=4)
    assert a.ids.shape == (4, 64) and torch.equal(a.ids, b.ids) and not torch.equal(a.ids, c.ids)
    assert all(src for src in a.sources) and a.describe()[0]["sources"] == a.sources[0]


def test_user_data_txt_jsonl_and_directory(tmp_path):
    (tmp_path / "a.txt").write_text("First document. " * 5)
    (tmp_path / "b.jsonl").write_text('{"text": "second"}\n\n{"text": "third", "id": 3}\n')
    (tmp_path / "ignored.csv").write_text("x,y")
    docs = corpus.user_documents(tmp_path)
    assert [d.source for d in docs] == ["a.txt", "b.jsonl:1", "b.jsonl:3"]
    assert corpus.load_documents(str(tmp_path / "b.jsonl"))[1].text == "third"


@pytest.mark.parametrize("content, suffix, needle", [
    ('{"txt": "no text field"}\n', ".jsonl", "no string field 'text'"),
    ('{"text": "ok"}\n{broken\n', ".jsonl", ":2 is not valid JSON"),
    (b"\xff\xfe\x00bad", ".txt", "UTF-8"),
    ("   \n", ".txt", "contains no text"),
    ("a,b", ".csv", "must be a .txt or .jsonl"),
])
def test_bad_user_data_is_a_clear_error(tmp_path, content, suffix, needle):
    p = tmp_path / f"data{suffix}"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(InputError, match=needle.replace("(", r"\(")):
        corpus.user_documents(p)


def test_missing_and_empty_dataset(tmp_path):
    with pytest.raises(InputError, match="does not exist"):
        corpus.user_documents(tmp_path / "nope.txt")
    with pytest.raises(InputError, match="holds no .txt or .jsonl"):
        corpus.user_documents(tmp_path)


def test_too_little_data_is_an_error(tmp_path):
    (tmp_path / "short.txt").write_text("Only a few words here.")
    with pytest.raises(InputError, match="tokens but 2 samples x 64 tokens"):
        corpus.token_windows(H.load_tokenizer_fast(), corpus.user_documents(tmp_path), 2, 64, 0)


# ------------------------------------------------------------------- stats
def test_stats_amax_and_histogram_match_direct_computation():
    g = torch.Generator().manual_seed(0)
    st = KVStats(2, 3, 8)
    xs = [torch.randn(50, 3, 8, generator=g) * 3 for _ in range(4)]
    st(1, xs[0], xs[1])
    st(1, xs[2], xs[3])
    st(0, torch.zeros(5, 3, 8), torch.full((5, 3, 8), 1.0))
    k = torch.cat((xs[0], xs[2])).abs()
    assert torch.equal(st.channel_amax[1, 0], k.amax(dim=0))
    assert torch.equal(st.hist[1, 0].sum(dim=-1), torch.full((3,), 100 * 8))
    assert st.hist[0, 0, :, 0].tolist() == [40, 40, 40]  # zeros: the underflow bin
    one_bin = 1 + (0 - LOG2_LO) * BINS_PER_OCTAVE  # |x| = 1.0 = 2^0 opens this bin
    assert st.hist[0, 1, :, one_bin].tolist() == [40, 40, 40]
    assert st.tokens.tolist() == [5, 100]


def test_nan_activation_names_the_layer():
    st = KVStats(4, 1, 2)
    v = torch.tensor([[[1.0, float("inf")]]])
    with pytest.raises(NumericsError, match="layer 2: V activations contain NaN/Inf"):
        st(2, torch.ones(1, 1, 2), v)


# ---------------------------------------------------------------- policies
def _stats_from(x: torch.Tensor) -> KVStats:
    """x [tokens, heads, dim] observed as both K and V of a 1-layer model."""
    st = KVStats(1, x.shape[1], x.shape[2])
    st(0, x, x)
    return st


def _true_rel_error(x: torch.Tensor, clip: torch.Tensor, fmt: KVFormat) -> float:
    s = clip.to(torch.float32) / QMAX[fmt.dtype]
    err = dequantize(quantize(x, fmt, s), fmt, s) - x
    return float((err.double() ** 2).sum() / (x.double() ** 2).sum())


@pytest.mark.parametrize("fmt", static_formats(), ids=lambda f: f.name)
def test_max_policy_scale_is_amax_over_qmax(fmt):
    x = torch.randn(400, 3, 16, generator=torch.Generator().manual_seed(1)) * torch.tensor([1.0, 5.0, 0.2])[:, None]
    k, v = scales_from_stats(_stats_from(x), fmt, "max")
    amax = x.abs().amax(dim=(0, 2)) if fmt.granularity == "per_head" else x.abs().amax()
    want = (amax / QMAX[fmt.dtype]).reshape(1, -1) if fmt.granularity == "per_head" else (amax / QMAX[fmt.dtype]).view(1)
    torch.testing.assert_close(k.scale, want, rtol=1e-6, atol=0)
    torch.testing.assert_close(v.scale, want, rtol=1e-6, atol=0)


def test_percentile_clip_matches_quantile_within_bin_resolution():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20000, 1, 4, generator=g)
    x[0, 0, 0] = 40.0  # one outlier
    amax, hist = pooled(_stats_from(x), 0, "per_tensor")
    r = choose_clip(amax, hist, KVFormat("int8"), "percentile", percentile=99.0)
    true_q = float(torch.quantile(x.abs().flatten(), 0.99))
    assert true_q <= float(r.clip[0]) <= true_q * 2 ** (1.5 / BINS_PER_OCTAVE)
    assert float(r.clip[0]) < 40.0


@pytest.mark.parametrize("dtype", ["int4", "int8", "fp8_e4m3"])
def test_mse_clip_is_near_the_true_optimum(dtype):
    """Heavy-tailed data: the MSE policy's clip must be (nearly) as good as a brute-force search
    on the raw values, never worse than clipping at amax, and its error estimate must be right."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(8000, 1, 8, generator=g) * torch.rand(8000, 1, 1, generator=g) ** 3 * 4)
    fmt = KVFormat(dtype, "per_tensor")
    amax, hist = pooled(_stats_from(x), 0, "per_tensor")
    r = choose_clip(amax, hist, fmt, "mse")
    grid = float(amax[0]) * torch.linspace(0.1, 1.0, 181)
    brute = min(_true_rel_error(x, c, fmt) for c in grid)
    got = _true_rel_error(x, r.clip[0], fmt)
    at_max = _true_rel_error(x, amax[0], fmt)
    assert got <= brute * 1.05 + 1e-12
    assert got <= at_max * 1.0001
    assert math.isclose(float(r.rel_error[0]), got, rel_tol=0.15)
    assert math.isclose(float(r.rel_error_at_max[0]), at_max, rel_tol=0.15)
    if dtype == "int4":
        assert float(r.clip[0]) < 0.8 * float(amax[0])  # int4 gains from clipping the tail


def test_unknown_policy_and_dynamic_format_rejected():
    st = _stats_from(torch.ones(4, 1, 2))
    with pytest.raises(InputError, match="unknown scale policy"):
        scales_from_stats(st, KVFormat("int8"), "median")
    with pytest.raises(InputError, match="no calibrated scales"):
        scales_from_stats(st, KVFormat("int8", "per_token"), "max")


# ------------------------------------------------- the stage, tiny model
@pytest.fixture(scope="module")
def tiny_calib(tmp_path_factory):
    out = tmp_path_factory.mktemp("calib")
    facts = run_calibration(H.tiny_model_dir(), out, num_samples=4, seq_len=64, policy="mse", seed=0)
    return out, facts


def test_stage_outputs_and_scales_for(tiny_calib):
    out, facts = tiny_calib
    assert sorted(facts["outputs"]) == sorted(p.name for p in out.iterdir())
    report = json.loads((out / "calibration.json").read_text())
    assert report["policy"] == "mse" and report["tokens_per_layer"] == 4 * 64
    assert len(report["data"]["samples"]) == 4 and report["data"]["samples"][0]["sources"]
    assert set(report["formats"]) == {f"{f.dtype}.{f.granularity}" for f in static_formats()}
    k_amax, v_amax = layer_amax(out)
    assert k_amax.shape == (2,) and bool((k_amax > 0).all()) and bool((v_amax > 0).all())
    k, v = scales_for(out, KVFormat("int4", "per_head"))
    assert k.shape == (2, 2) and v.dtype == torch.float32
    # another policy is derived from the stored statistics: max = amax / qmax exactly
    k_max, _ = scales_for(out, KVFormat("int8", "per_tensor"), policy="max")
    torch.testing.assert_close(k_max, k_amax / 127.0, rtol=1e-6, atol=0)
    assert bool((k <= scales_for(out, KVFormat("int4", "per_head"), policy="max")[0] * (1 + 1e-6)).all())


def test_streaming_equals_whole_model_on_tiny(tmp_path):
    from calibration.calibrate import calibration_windows, collect_stats
    from runtime.config import ModelConfig

    d = H.tiny_model_dir()
    w, _ = calibration_windows(d, ModelConfig.from_dir(d), "builtin", 3, 48, 1)
    a, b = collect_stats(d, w, streaming=False), collect_stats(d, w, streaming=True)
    assert torch.equal(a.channel_amax, b.channel_amax) and torch.equal(a.hist, b.hist)


def test_nan_weights_stop_calibration_and_cli_leaves_no_output(tmp_path):
    bad = H.make_tiny_model_dir(tmp_path / "bad", nan_layer=1)
    out = tmp_path / "calib"
    proc = H.kvq_cli("calibrate", "--model", str(bad), "--out", str(out), "--num-samples", "2", "--seq-len", "32")
    assert proc.returncode == NumericsError.exit_code, proc.stderr
    assert "layer 1: K activations contain NaN/Inf" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists() and not any(p.name.startswith(".calib") for p in tmp_path.iterdir())


def test_missing_model_dir_is_input_error(tmp_path):
    with pytest.raises(InputError, match="config.json does not exist"):
        run_calibration(tmp_path / "nope", tmp_path)


def test_calibrate_cli_success_and_bad_dataset(tmp_path):
    d = H.tiny_model_dir()
    ok = H.kvq_cli("calibrate", "--model", str(d), "--out", str(tmp_path / "ok"), "--num-samples", "2",
                   "--seq-len", "32", "--policy", "percentile", "--streaming")
    assert ok.returncode == 0, ok.stderr
    assert {p.name for p in (tmp_path / "ok").iterdir()} == {
        "kv_scales.safetensors", "kv_stats.safetensors", "calibration.json", "manifest.json"}
    assert json.loads((tmp_path / "ok" / "calibration.json").read_text())["mode"] == "layer-streaming"
    bad = tmp_path / "data.jsonl"
    bad.write_text('{"body": "x"}\n')
    proc = H.kvq_cli("calibrate", "--model", str(d), "--out", str(tmp_path / "bad"), "--dataset", str(bad))
    assert proc.returncode == InputError.exit_code
    assert "data.jsonl:1 has no string field 'text'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "bad").exists()
