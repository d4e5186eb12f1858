"""benchmarks/served_layer_formats.py: the per-layer choice the served benchmark reads, what it serves beside
it, and the static scales its synthetic engines get (the tritonserver run itself is the GPU benchmark's)."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest

from benchmarks import served_layer_formats as layered
from runtime.engine_dir import parse_kv_format_name
from runtime.errors import InputError

ROOT = Path(__file__).resolve().parents[1]
TINY_CHOICE = ROOT / "tests" / "data" / "tiny_kv_layers.yaml"
INT8_HEAD, INT4_ASYM, BF16 = (parse_kv_format_name(n) for n in ("int8-per_head", "int4-per_token-asym", "bf16"))


def test_reads_recipe_kv_yaml_and_kv_format_json(tmp_path):
    assert layered.read_layer_formats(TINY_CHOICE, 2) == (INT8_HEAD, INT4_ASYM)
    mixed = tmp_path / "kv_format.json"
    mixed.write_text(json.dumps({"layers": [{"dtype": "int4", "granularity": "per_token", "symmetric": False},
                                            {"dtype": "int8", "granularity": "per_head"}]}))
    assert layered.read_layer_formats(mixed, 2) == (INT4_ASYM, INT8_HEAD)
    uniform = tmp_path / "uniform.json"  # the search may choose one format for every layer
    uniform.write_text(json.dumps({"dtype": "int8", "granularity": "per_head"}))
    assert layered.read_layer_formats(uniform, 3) == (INT8_HEAD,) * 3


@pytest.mark.parametrize("name, text, words", [
    ("missing.yaml", None, ["does not exist", "recipe_kv.yaml"]),
    ("no_layers.yaml", "kv: {dtype: int8}\n", ["kv.layers"]),
    ("gap.yaml", "kv: {layers: {'0': int8-per_token}}\n", ["layers [1]", "every layer"]),
    ("bad_name.yaml", "kv: {layers: {'0-1': int9}}\n", ["'0-1'"]),
    ("too_few.json", json.dumps({"layers": [{"dtype": "int8", "granularity": "per_token"}]}), ["2 layers", "got 1"]),
    ("list.json", "[1, 2]", ["object"]),
    ("broken.json", "{", ["not JSON"]),
])
def test_bad_choice_files_are_input_errors_naming_the_file(tmp_path, name, text, words):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(InputError) as e:
        layered.read_layer_formats(path, 2)
    assert str(path) in str(e.value) and all(w in str(e.value) for w in words), str(e.value)


def test_comparison_serves_the_choice_then_bf16_and_each_format_it_uses():
    got = layered.comparison((INT8_HEAD, INT4_ASYM, INT8_HEAD))
    assert [label for label, _ in got] == ["per-layer", "bf16", "int8-per_head", "int4-per_token-asym"]
    assert got[0][1] == (INT8_HEAD, INT4_ASYM, INT8_HEAD)
    assert all(fmts == (fmts[0],) * 3 for _, fmts in got[1:])
    # a uniform choice is one of the uniform engines already; explicit uniform formats replace the defaults
    assert [label for label, _ in layered.comparison((INT4_ASYM,) * 2)] == ["bf16", "int4-per_token-asym"]
    assert [label for label, _ in layered.comparison((INT8_HEAD, INT4_ASYM), [INT4_ASYM])] == [
        "per-layer", "int4-per_token-asym"]


def test_synthetic_mixed_engine_gets_calibrated_scales_for_its_static_layers(tmp_path):
    """Layer 0 (int8 per head) gets amax / 127 of the calibration's own K/V statistics; layer 1 (dynamic)
    none; the engine loads and generates."""
    from safetensors.torch import load_file

    from benchmarks.served_vs_inprocess import make_engine_dir
    from runtime.engine import Engine

    args = types.SimpleNamespace(concurrency=2, prompt_len=8, output_len=4, block_size=16, device="cpu")
    d = make_engine_dir(tmp_path, "mixed", (INT8_HEAD, INT4_ASYM), "tiny-llama3", args)
    scales = load_file(str(d / "kv_scales.safetensors"))
    assert sorted(scales) == ["k_scale.0", "v_scale.0"]
    amax = load_file(str(tmp_path / "calibration-tiny-llama3" / "kv_scales.safetensors"))
    for kv in "kv":
        expect = amax[f"amax.{kv}"][0].double() / 127
        assert scales[f"{kv}_scale.0"].shape == expect.shape == (2,)  # tiny-llama3: 2 KV heads
        assert (scales[f"{kv}_scale.0"].double() - expect).abs().max() <= 1e-6 * expect.max()
        assert (expect > 0).all()
    engine = Engine.from_dir(d, device="cpu")
    try:
        assert engine.stats.kv_format == "L0:int8-per_head,L1:int4-per_token-asym"
        outs = engine.generate([[5, 6, 7, 8], [9, 10, 11]], max_tokens=4, temperature=0.0)
        assert [len(o.token_ids) for o in outs] == [4, 4]
    finally:
        engine.shutdown()
    assert not (tmp_path / "uniform").exists()
    bf16 = make_engine_dir(tmp_path, "uniform", (BF16, BF16), "tiny-llama3", args)
    assert not (bf16 / "kv_scales.safetensors").exists()


def test_the_default_choice_names_a_format_for_each_of_smollm2s_layers():
    from benchmarks.served_vs_inprocess import KV_LAYERS
    from runtime.config import PRESETS

    formats = layered.read_layer_formats(KV_LAYERS, PRESETS["smollm2-135m"].num_layers)
    assert len(formats) == 30 and len(set(formats)) > 1
    assert formats[10] == INT8_HEAD and formats[12] == parse_kv_format_name("fp8_e4m3-per_tensor")
