"""KV rotation (runtime/rotation.py): the matrix, its exactness, and the engine/pipeline around it.

References are computed here, independently of the code under test: the Hadamard matrix from its
closed form H[i, j] = (-1)^popcount(i & j) / sqrt(n) in fp64, rotated K/V as the unrotated model's
K/V times that matrix.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers_cli import run_cli
from helpers_runtime import tiny_llama_dir

from recipes.schema import Recipe
from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.errors import InputError, UnsupportedError
from runtime.model import LlamaModel
from runtime.rotation import KVRotation, fold_o_proj, fold_v_proj, walsh_hadamard
from runtime.weights import open_weights

PROMPTS = [[(11 * j + 7 * i) % 500 + 3 for j in range(13 + 9 * i)] for i in range(4)]
FP32_EPS = torch.finfo(torch.float32).eps


def hadamard_reference(n: int) -> torch.Tensor:
    i = torch.arange(n)
    parity = torch.tensor([[bin(a & b).count("1") % 2 for b in i.tolist()] for a in i.tolist()], dtype=torch.float64)
    return (1 - 2 * parity) / n**0.5


@pytest.mark.parametrize("n", [1, 2, 16, 64, 128])
def test_walsh_hadamard_equals_the_closed_form_and_is_orthogonal(n):
    h = walsh_hadamard(n)
    assert torch.equal(h, hadamard_reference(n))
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)


@pytest.mark.parametrize("seed", [None, 0, 7])
def test_rotation_matrix_is_orthogonal_in_fp32_and_signs_are_fixed_by_the_seed(seed):
    n = 128
    rot = KVRotation("hadamard", seed)
    m64 = rot.matrix(n, torch.float64)
    signs = rot.signs(n)
    assert set(signs.tolist()) <= {-1.0, 1.0}
    assert torch.equal(m64, signs[:, None] * hadamard_reference(n))
    m = rot.matrix(n)  # fp32: entries +-1/sqrt(n) rounded once, so M M^T = I to a few ulps per dot product
    err = (m.double() @ m.double().T - torch.eye(n, dtype=torch.float64)).abs().max().item()
    assert err < 4 * FP32_EPS
    assert torch.equal(KVRotation("hadamard", seed).signs(n), signs)  # same seed, same vector
    if seed is not None:
        assert (KVRotation("hadamard", seed + 1).signs(n) != signs).any()


def test_rotation_needs_a_power_of_two_head_dim_and_a_known_kind():
    with pytest.raises(UnsupportedError, match="power-of-two head_dim"):
        KVRotation("hadamard").matrix(48)
    with pytest.raises(UnsupportedError, match="kv.rotation: unknown rotation 'givens'"):
        KVRotation("givens")
    with pytest.raises(UnsupportedError, match="rotation_seed"):
        KVRotation("hadamard", -1)


def test_folded_projections_rotate_v_and_undo_it_for_every_query_head_of_a_gqa_group():
    """fp64: attention with v' = v M and o_proj' = o_proj M^T-folded equals the unrotated output."""
    g = torch.Generator().manual_seed(0)
    hidden, kv_heads, group, d, t = 24, 2, 3, 16, 5
    w_v = torch.randn(kv_heads * d, hidden, generator=g, dtype=torch.float64)
    w_o = torch.randn(hidden, kv_heads * group * d, generator=g, dtype=torch.float64)
    x = torch.randn(t, hidden, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.randn(kv_heads * group, t, t, generator=g, dtype=torch.float64), -1)
    m = KVRotation("hadamard", 3).matrix(d, torch.float64)

    def out(wv, wo):
        v = (x @ wv.T).view(t, kv_heads, d).transpose(0, 1)  # [kv_heads, T, D]
        v = v.repeat_interleave(group, 0)  # query head h reads KV head h // group
        attn = (p @ v).transpose(0, 1).reshape(t, -1)
        return attn @ wo.T

    assert torch.allclose(out(fold_v_proj(w_v, m), fold_o_proj(w_o, m)), out(w_v, w_o), atol=1e-12, rtol=0)
    v_rot = (x @ fold_v_proj(w_v, m).T).view(t, kv_heads, d)
    assert torch.allclose(v_rot, (x @ w_v.T).view(t, kv_heads, d) @ m, atol=1e-12, rtol=0)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory)


def test_rotated_model_stores_rotated_k_after_rope_and_rotated_v(tiny_dir):
    """What calibration observes (and the cache stores): the unrotated K (after RoPE) and V times M."""
    cfg = ModelConfig.from_dir(tiny_dir)
    rot = KVRotation("hadamard", 0)
    m = rot.matrix(cfg.head_dim, torch.float64)
    seen = {}

    def observer(name):
        def observe(i, k, v):
            seen[(name, i)] = (k.double(), v.double())
        return observe

    ids = torch.tensor(PROMPTS[3])
    plain = LlamaModel(cfg, open_weights(tiny_dir, cfg))
    rotated = LlamaModel(cfg, open_weights(tiny_dir, cfg), rotation=rot)
    plain.forward_dense(ids, observer=observer("plain"))
    rotated.forward_dense(ids, observer=observer("rot"))
    for i in range(cfg.num_layers):
        (k0, v0), (k1, v1) = seen[("plain", i)], seen[("rot", i)]
        scale = max(k0.abs().max().item(), v0.abs().max().item())
        tol = 64 * FP32_EPS * scale  # fp32 rounding of a head_dim-long dot product, relative to the values
        assert (k1 - k0 @ m).abs().max().item() < tol
        assert (v1 - v0 @ m).abs().max().item() < tol
        assert (k1 - k0).abs().max().item() > 0.1 * scale  # really rotated


def test_rotated_engine_scores_equal_the_unrotated_engine_without_quantization(tiny_dir):
    """Rotation is exact without quantization: fp32 KV, same log-probabilities within fp32 rounding."""
    plain = Engine.from_dir(tiny_dir, kv_format="fp32", num_blocks=64)
    rot = Engine.from_dir(tiny_dir, kv_format="fp32", num_blocks=64, kv_rotation=KVRotation("hadamard", 5))
    try:
        assert rot.stats.kv_rotation == "hadamard-s5" and plain.stats.kv_rotation == "none"
        a, b = plain.score(PROMPTS), rot.score(PROMPTS)
        for x, y in zip(a, b):
            # logprobs are O(10) here; a few thousand fp32 ops per logit, each rounding to 1 ulp
            assert (x.logprobs - y.logprobs).abs().max().item() < 1e-4
        ga = plain.generate(PROMPTS, max_tokens=12, ignore_eos=True)
        gb = rot.generate(PROMPTS, max_tokens=12, ignore_eos=True)
        assert [g.token_ids for g in ga] == [g.token_ids for g in gb]
    finally:
        plain.shutdown()
        rot.shutdown()


@pytest.mark.parametrize("fmt", ["int4-per_token-asym", "int8-per_token"])
def test_rotated_quantized_engine_batched_equals_sequential(tiny_dir, fmt):
    eng = Engine.from_dir(tiny_dir, kv_format=fmt, num_blocks=64, kv_rotation="hadamard")
    try:
        alone = [eng.generate([p], max_tokens=16, ignore_eos=True)[0].token_ids for p in PROMPTS]
        together = [g.token_ids for g in eng.generate(PROMPTS, max_tokens=16, ignore_eos=True)]
        assert together == alone
        scored_alone = [eng.score([p])[0].logprobs for p in PROMPTS]
        for x, y in zip(eng.score(PROMPTS), scored_alone):
            assert torch.equal(x.logprobs, y)
    finally:
        eng.shutdown()


def test_rotation_reduces_int4_key_error_on_outlier_channels():
    """Why it exists: a key with one outlier channel loses its other channels at 4 bits per token;
    rotated, the error (measured in the unrotated basis, fp64 reference) is several times smaller."""
    from runtime.kv_format import KVFormat
    from runtime.kv_quant import dequantize, quantize_dynamic

    g = torch.Generator().manual_seed(0)
    d = 64
    k = torch.randn(256, 1, d, generator=g, dtype=torch.float64)
    k[..., 5] *= 30  # one outlier channel, as SmolLM2's keys have (calibration.json lists them)
    fmt = KVFormat("int4", "per_token", False, "float32")
    m = KVRotation("hadamard", 0).matrix(d, torch.float64)

    def err(x):
        q, s, z = quantize_dynamic(x.float(), fmt)
        return dequantize(q, fmt, s, z).double()

    plain = (err(k) - k).norm() / k.norm()
    rotated = (err(k @ m) @ m.T - k).norm() / k.norm()
    assert rotated < plain / 3


def test_engine_dir_rotation_is_read_back_and_a_tampered_sign_vector_is_refused(tiny_dir, tmp_path):
    import shutil

    d = tmp_path / "eng"
    shutil.copytree(tiny_dir, d)
    cfg = ModelConfig.from_dir(d)
    rot = KVRotation("hadamard", 2)
    spec = {"dtype": "int8", "granularity": "per_token", "symmetric": True, "scale_dtype": "float16",
            "rotation": rot.to_json(cfg.head_dim)}
    (d / "kv_format.json").write_text(json.dumps(spec))
    eng = Engine.from_dir(d, num_blocks=16)
    assert eng.stats.kv_rotation == "hadamard-s2" and eng.stats.kv_format == "int8-per_token"
    eng.shutdown()
    spec["rotation"]["signs"][0] *= -1
    (d / "kv_format.json").write_text(json.dumps(spec))
    with pytest.raises(InputError, match="signs differ"):
        Engine.from_dir(d, num_blocks=16)
    spec["rotation"] = {"kind": "hadamrd", "seed": 0}
    (d / "kv_format.json").write_text(json.dumps(spec))
    with pytest.raises(InputError, match="unknown rotation 'hadamrd'"):
        Engine.from_dir(d, num_blocks=16)


def _recipe(**kv):
    return {"name": "r", "model": {"source": "synthetic", "preset": "smollm2-135m"}, "kv": kv}


def test_recipe_rotation_field_and_tensorrt_llm_rejects_it_with_the_alternatives():
    r = Recipe.model_validate(_recipe(dtype="int4", granularity="per_token", symmetric=False, rotation="hadamard"))
    assert r.kv.kv_rotation() == KVRotation("hadamard", 0)
    with pytest.raises(ValueError, match="kv.rotation"):
        Recipe.model_validate(_recipe(rotation="givens"))
    with pytest.raises(ValueError, match="kv.rotation: TensorRT-LLM.*kv.rotation: none.*backend: torch"):
        Recipe.model_validate({**_recipe(dtype="fp8_e4m3", rotation="hadamard"), "backend": "tensorrt-llm"})


TINY = """name: tiny-rot-{rotation}
model: {{source: hf, path: {path}, dtype: fp32}}
kv: {{dtype: fp8_e4m3, granularity: per_tensor, rotation: {rotation}}}
calibration: {{num_samples: 2, seq_len: 16}}
build: {{max_batch_size: 2, max_input_len: 32, max_seq_len: 64, block_size: 16}}
accuracy: {{enabled: false}}
"""


@pytest.mark.slow
def test_pipeline_calibrates_rotated_kv_separately_and_records_the_rotation(tmp_path, capsys):
    from helpers_convert import make_hf_dir, tiny_cfg

    from calibration.calibrate import scales_for
    from runtime.kv_format import KVFormat

    make_hf_dir(tmp_path / "hf", tiny_cfg(heads=4, kv_heads=2, layers=2, vocab=97, head_dim=8))
    work = tmp_path / "work"
    engines = {}
    for rotation in ("none", "hadamard"):
        recipe = tmp_path / f"{rotation}.yaml"
        recipe.write_text(TINY.format(path=tmp_path / "hf", rotation=rotation))
        code, text = run_cli(["build", "--recipe", str(recipe), "--work-dir", str(work), "--until", "deploy"], capsys)
        assert code == 0, text
        engines[rotation] = work / "engines" / f"tiny-rot-{rotation}" / "engine"
    (model,) = (work / "models").iterdir()
    cals = sorted(p.name for p in model.iterdir() if p.name.startswith("calibrate-"))
    assert len(cals) == 2 and cals[1].endswith("-hadamard-s0")
    kv = json.loads((engines["hadamard"] / "kv_format.json").read_text())
    assert kv["rotation"] == KVRotation("hadamard", 0).to_json(8)
    assert "rotation" not in json.loads((engines["none"] / "kv_format.json").read_text())
    assert json.loads((engines["hadamard"] / "engine.json").read_text())["kv_rotation"] == "hadamard-s0"
    report = json.loads((model / cals[1] / "calibration.json").read_text())
    assert report["kv_rotation"]["kind"] == "hadamard"
    fmt = KVFormat("fp8_e4m3", "per_tensor")
    k_plain, _ = scales_for(model / cals[0], fmt)
    k_rot, _ = scales_for(model / cals[1], fmt)
    assert not torch.equal(k_plain, k_rot)  # statistics of what each engine stores
    pbtxt = (engines["hadamard"].parent / "triton_repo" / "kvq_engine" / "config.pbtxt").read_text()
    assert '"kv_rotation"' in pbtxt and '"hadamard-s0"' in pbtxt
    eng = Engine.from_dir(engines["hadamard"], num_blocks=8)
    try:
        assert eng.stats.kv_rotation == "hadamard-s0"
        assert torch.equal(eng.runner.caches[0].k_scale, k_rot[0])
    finally:
        eng.shutdown()


@pytest.mark.slow
def test_evaluation_scores_rotated_engines_and_the_extra_text(tmp_path):
    import helpers_calibration as H

    from calibration.evaluate import EngineKV, EvalSettings, run_evaluation
    from runtime.kv_format import KVFormat

    ood = Path(__file__).parents[1] / "calibration" / "data" / "out_of_domain"
    settings = EvalSettings(perplexity_tokens=128, perplexity_window=128, greedy_prompts=1, greedy_tokens=4,
                            passkey_lengths=[128], passkey_trials=1, attention_tokens=32, engine_greedy=False,
                            extra_eval_data=[str(ood)])
    fmt = KVFormat("int4", "per_token", False)
    engines = [EngineKV("plain", fmt), EngineKV("rot", fmt, rotation=KVRotation("hadamard", 0))]
    res = run_evaluation(H.tiny_model_dir(), engines, tmp_path, settings)
    base = res["baseline"]["perplexity_extra"][str(ood)]["perplexity"]
    for name, rot in (("plain", "none"), ("rot", "hadamard-s0")):
        e = res["engines"][name]
        assert e["kv_rotation"] == rot
        extra = e["perplexity_extra"][str(ood)]
        assert extra["change_pct"] == pytest.approx((extra["perplexity"] / base - 1) * 100)
    assert res["engines"]["plain"]["perplexity"] != res["engines"]["rot"]["perplexity"]
    assert "| rot | int4 per_token asym + hadamard-s0 |" in (tmp_path / "accuracy.md").read_text()
