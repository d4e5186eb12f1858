"""The bad-input catalogue of `kvq-build`: recipes, weights, calibration data, command-line arguments.

Every kind is run through the real entry point (in-process, `builder.cli.main`)
and must give: the typed error's exit code, a message that names the field or
file and says what to do, no traceback, and nothing written or lost: no
partial stage directory (not even an empty work dir), the weights untouched,
and the outputs of earlier stages exactly as they were. Request kinds live in
tests/test_bad_requests.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers_cli import run_cli
from helpers_convert import make_hf_dir, tiny_cfg
from safetensors.torch import load_file, save_file

from builder.pipeline import read_manifest
from runtime.errors import InputError, RecipeError, StageError, UnsupportedError

RECIPE = "recipe.yaml"
# A torch-backend recipe for the tiny HF model; {path} is its directory. No preset: the
# geometry comes from the weights.
TINY = """name: tiny
backend: torch
model: {{source: hf, path: {path}, dtype: fp32}}
kv: {{dtype: int8, granularity: per_tensor}}
calibration: {{num_samples: 2, seq_len: 16}}
build: {{max_batch_size: 2, max_input_len: 64, max_seq_len: 128}}
accuracy: {{enabled: false}}
deploy: {{enabled: false}}
"""


def snapshot(root: Path) -> dict[str, str]:
    """Every file under root with its content digest (directories as empty entries)."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


def _yaml(tmp: Path, text: str) -> str:
    (tmp / RECIPE).write_text(text)
    return str(tmp / RECIPE)


def _tiny(tmp: Path, **edits) -> str:
    """The tiny recipe with top-level YAML lines appended (later keys override)."""
    return _yaml(tmp, TINY.format(path=tmp / "hf") + "".join(f"{k}: {v}\n" for k, v in edits.items()))


def _rewrite(d: Path, fn) -> None:
    sd = load_file(str(d / "model.safetensors"))
    fn(sd)
    save_file(sd, str(d / "model.safetensors"))


def _config(d: Path, **kw) -> None:
    c = json.loads((d / "config.json").read_text())
    c.update(kw)
    (d / "config.json").write_text(json.dumps(c))


def _nan(sd):
    w = sd["model.layers.1.mlp.down_proj.weight"].clone()
    w[3, 5] = float("nan")
    sd["model.layers.1.mlp.down_proj.weight"] = w


def _truncate(d: Path) -> None:
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _smollm2_gguf() -> str:
    from builder.convert.builtin import builtin_gguf_path

    return str(builtin_gguf_path("smollm2-135m"))


def _index_missing_shard(d: Path) -> None:
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.norm.weight": "model-00002-of-00002.safetensors",
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))


# ---------------------------------------------------------------- recipes
# id -> (argv after `build --work-dir W`, built from tmp; exit code; fragments of the message)
RECIPES = {
    "unknown top-level key": (lambda t: ["--recipe", _tiny(t, colour="red")], 2, ["colour", "unknown field"]),
    "unknown nested key": (lambda t: ["--recipe", _tiny(t, kv="{dtyp: int8}")], 2, ["kv.dtyp", "spelling"]),
    "wrong type": (lambda t: ["--recipe", _tiny(t), "--set", "build.max_batch_size=lots"], 2,
                   ["build.max_batch_size", "integer"]),
    "out of range": (lambda t: ["--recipe", _tiny(t), "--set", "build.max_batch_size=0"], 2,
                     ["build.max_batch_size", "greater than or equal to 1"]),
    "unknown kv dtype": (lambda t: ["--recipe", _tiny(t), "--set", "kv.dtype=int3"], 2, ["kv.dtype", "int3", "int8"]),
    "unknown backend": (lambda t: ["--recipe", _tiny(t), "--set", "backend=vllm"], 2, ["backend", "tensorrt-llm"]),
    "int4 with tensorrt-llm": (lambda t: ["--recipe", _tiny(t, backend="tensorrt-llm"), "--set", "kv.dtype=int4"], 2,
                               ["kv.dtype", "no INT4", "backend: torch"]),
    "per_token with tensorrt-llm": (lambda t: ["--recipe", _tiny(t, backend="tensorrt-llm"), "--set",
                                               "kv.granularity=per_token"], 2, ["kv.granularity", "per_tensor"]),
    "max_input_len above max_seq_len": (lambda t: ["--recipe", _tiny(t), "--set", "build.max_input_len=4096"], 2,
                                        ["build.max_input_len", "raise max_seq_len"]),
    "pp on the torch backend": (lambda t: ["--recipe", _tiny(t), "--set", "build.pp=2"], 2,
                                ["build.pp", "pp: 1", "build.tp"]),
    "unknown preset": (lambda t: ["--recipe", _tiny(t), "--set", "model.preset=gpt5"], 2,
                       ["model.preset", "gpt5", "smollm2-135m"]),
    "hf source without a path": (lambda t: ["--recipe", _tiny(t), "--set", "model.path=null"], 2,
                                 ["model.path", "--set model.path="]),
    "tp not dividing the preset's heads": (lambda t: ["--recipe", "llama70b-fp8kv", "--set", "build.tp=3"], 2,
                                           ["build.tp", "64 attention heads"]),
    "invalid YAML": (lambda t: ["--recipe", _yaml(t, "kv: {dtype: [int8\n")], 2, ["not valid YAML", "line"]),
    "recipe is not a mapping": (lambda t: ["--recipe", _yaml(t, "- a\n- list\n")], 2, ["mapping", "list"]),
    "extends cycle": (lambda t: ["--recipe", _yaml(t, f"extends: {t / RECIPE}\n")], 2, ["extends", "cycle"]),
    "unknown recipe name": (lambda t: ["--recipe", "llama71b-fp8kv"], 2, ["llama71b-fp8kv", "kvq recipes list"]),
    "missing recipe file": (lambda t: ["--recipe", str(t / "nope.yaml")], 2, ["nope.yaml", "does not exist"]),
    "--set without =": (lambda t: ["--recipe", _tiny(t), "--set", "kv.dtype"], 2, ["KEY.PATH=VALUE"]),
    "--set into a value": (lambda t: ["--recipe", _tiny(t), "--set", "kv.dtype.bits=4"], 2,
                           ["kv.dtype", "not a section"]),
}

# ------------------------------------------------------------------ weights
WEIGHTS = {
    "weights directory missing": (lambda d: shutil.rmtree(d), InputError, ["hf", "--set model.path="]),
    "config.json missing": (lambda d: (d / "config.json").unlink(), InputError, ["config.json", "does not exist"]),
    "config.json not JSON": (lambda d: (d / "config.json").write_text("{oops"), InputError,
                             ["config.json", "not readable JSON"]),
    "not a Llama": (lambda d: _config(d, architectures=["GPT2LMHeadModel"], model_type="gpt2"), UnsupportedError,
                    ["config.json", "GPT2LMHeadModel", "Llama"]),
    "missing tensor": (lambda d: _rewrite(d, lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight")),
                       InputError, ["model.layers.1.self_attn.k_proj.weight", "missing", "incomplete"]),
    "wrong shape": (lambda d: _rewrite(d, lambda sd: sd.update({"model.layers.0.mlp.up_proj.weight":
                                                                  torch.zeros(40, 32)})),
                    InputError, ["model.layers.0.mlp.up_proj.weight", "[40, 32]", "[48, 32]"]),
    "NaN weights": (lambda d: _rewrite(d, _nan), InputError, ["model.layers.1.mlp.down_proj.weight", "NaN", "corrupt"]),
    "truncated safetensors": (_truncate, InputError, ["model.safetensors", "truncated", "re-download"]),
    "extra module": (lambda d: _rewrite(d, lambda sd: sd.update({"model.layers.0.self_attn.q_proj.bias":
                                                                   torch.zeros(32)})),
                     UnsupportedError, ["model.layers.0.self_attn.q_proj.bias", "plain Llama"]),
    "pickled weights only": (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"), UnsupportedError,
                             ["*.bin", "safetensors"]),
    "index names a missing shard": (_index_missing_shard, InputError,
                                    ["model-00002-of-00002.safetensors", "complete checkpoint"]),
    "quantized tensors": (lambda d: _rewrite(d, lambda sd: sd.update({"model.norm.weight":
                                                                        sd["model.norm.weight"].to(torch.int8)})),
                          UnsupportedError, ["model.norm.weight", "fp32/fp16/bf16"]),
}

# -------------------------------------------------------- calibration data
CALIBRATION = {
    "empty file": ("data.txt", b"", InputError, ["data.txt", "no text", "builtin"]),
    "binary file": ("data.txt", bytes(range(256)) * 8, InputError, ["data.txt", "UTF-8"]),
    "too short": ("data.txt", b"w3 w4 w5 w6", InputError, ["tokens", "32", "num_samples / seq_len"]),
    "jsonl without text": ("data.jsonl", b'{"body": "w3 w4"}\n', InputError, ["data.jsonl:1", "'text'"]),
    "jsonl not JSON": ("data.jsonl", b'{"text": "w3\n', InputError, ["data.jsonl:1", "not valid JSON"]),
    "unsupported file type": ("data.csv", b"w3,w4\n", InputError, ["data.csv", ".txt or .jsonl"]),
    "missing dataset": (None, None, InputError, ["missing.txt", "does not exist", "builtin"]),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> Path:
    """A work dir whose tiny model is converted (the earlier stage calibration cases must keep)."""
    root = tmp_path_factory.mktemp("converted")
    make_hf_dir(root / "hf", tiny_cfg())
    from builder.cli import main

    with pytest.raises(SystemExit) as info:
        main(["build", "--recipe", _tiny(root), "--work-dir", str(root / "work"), "--until", "convert"])
        raise SystemExit(0)
    assert not info.value.code
    return root


def _assert_clear(code: int, text: str, want_code: int, fragments: list[str]) -> None:
    assert code == want_code, text
    assert "Traceback" not in text
    for f in fragments:
        assert f in text, f"{f!r} not in: {text}"


@pytest.mark.parametrize("case", list(RECIPES))
def test_bad_recipe(case, tmp_path, capsys):
    argv, want, fragments = RECIPES[case]
    make_hf_dir(tmp_path / "hf", tiny_cfg(), tokenizer=False)
    args = ["build", "--work-dir", str(tmp_path / "work"), *argv(tmp_path)]
    before = snapshot(tmp_path)
    code, text = run_cli(args, capsys)
    _assert_clear(code, text, want, fragments)
    assert want == RecipeError.exit_code
    assert snapshot(tmp_path) == before  # not even the work dir


@pytest.mark.parametrize("case", list(WEIGHTS))
def test_bad_weights(case, tmp_path, capsys):
    edit, err, fragments = WEIGHTS[case]
    make_hf_dir(tmp_path / "hf", tiny_cfg())
    edit(tmp_path / "hf")
    recipe = _tiny(tmp_path)
    weights = snapshot(tmp_path / "hf")
    code, text = run_cli(["build", "--recipe", recipe, "--work-dir", str(tmp_path / "work")], capsys)
    _assert_clear(code, text, err.exit_code, fragments)
    assert not (tmp_path / "work").exists()  # no partial convert directory, no empty parents
    assert snapshot(tmp_path / "hf") == weights


def test_recipe_preset_not_the_weights_real_smollm2(tmp_path, capsys):
    """llama3-8b-fp8kv pointed at SmolLM2 (the real GGUF): the difference and the fix, nothing written."""
    args = ["build", "--recipe", "llama3-8b-fp8kv", "--set", "model.source=gguf", "--set",
            f"model.path={_smollm2_gguf()}", "--work-dir", str(tmp_path / "work")]
    code, text = run_cli(args, capsys)
    _assert_clear(code, text, RecipeError.exit_code, [
        "model.preset 'llama3-8b'", "num_hidden_layers (model.num_layers): preset 32, weights 30",
        "num_key_value_heads (model.num_kv_heads): preset 8, weights 3", "head_dim (model.head_dim): preset 128, "
        "weights 64", "vocab_size (model.vocab_size): preset 128256, weights 49152", "smollm2-135m-fp8kv",
        "--set model.preset=smollm2-135m", "--set model.preset=null"])
    assert not (tmp_path / "work").exists()


def test_recipe_without_preset_is_checked_with_the_weights_geometry(tmp_path, capsys):
    make_hf_dir(tmp_path / "hf", tiny_cfg(), tokenizer=False)  # 256 positions
    args = ["build", "--recipe", _tiny(tmp_path), "--set", "build.max_seq_len=512", "--work-dir",
            str(tmp_path / "work")]
    code, text = run_cli(args, capsys)
    _assert_clear(code, text, RecipeError.exit_code, ["geometry taken from them", "build.max_seq_len (512)",
                                                      "256 positions"])
    assert not (tmp_path / "work").exists()


@pytest.mark.parametrize("case", list(CALIBRATION))
def test_bad_calibration_data(case, converted, tmp_path, capsys):
    name, data, err, fragments = CALIBRATION[case]
    work = tmp_path / "work"
    shutil.copytree(converted / "work", work)
    dataset = tmp_path / (name or "missing.txt")
    if data is not None:
        dataset.write_bytes(data)
    before = snapshot(work)
    args = ["build", "--recipe", _tiny(converted), "--work-dir", str(work), "--until", "calibrate",
            "--set", f"calibration.dataset={dataset}"]
    code, text = run_cli(args, capsys)
    _assert_clear(code, text, err.exit_code, fragments)
    assert snapshot(work) == before  # convert intact, no calibrate directory, no temp dir


# ------------------------------------------------------ command-line arguments
def test_unknown_force_stage(converted, capsys, tmp_path):
    work = tmp_path / "work"
    shutil.copytree(converted / "work", work)
    before = snapshot(work)
    code, text = run_cli(["build", "--recipe", _tiny(converted), "--work-dir", str(work), "--force", "bake"], capsys)
    _assert_clear(code, text, StageError.exit_code, ["--force bake", "unknown stage", "convert, calibrate"])
    assert snapshot(work) == before


def test_unknown_until_stage(tmp_path, capsys):
    code, text = run_cli(["build", "--recipe", "smollm2-135m-fp8kv", "--until", "bake", "--work-dir",
                          str(tmp_path / "w")], capsys)
    _assert_clear(code, text, 2, ["--until", "bake", "convert"])
    assert not (tmp_path / "w").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA where there is none")
def test_cuda_device_without_cuda(tmp_path, capsys):
    code, text = run_cli(["build", "--recipe", "smollm2-135m-fp8kv", "--device", "cuda", "--work-dir",
                          str(tmp_path / "w")], capsys)
    _assert_clear(code, text, InputError.exit_code, ["--device cuda", "--device cpu"])
    assert not (tmp_path / "w").exists()


def test_convert_out_exists(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    code, text = run_cli(["convert", "--source", "synthetic:llama3-8b", "--out", str(tmp_path / "out")], capsys)
    _assert_clear(code, text, InputError.exit_code, ["already exists", "another output directory"])
    assert snapshot(tmp_path / "out") == {"keep.txt": hashlib.sha256(b"mine").hexdigest()}


def test_convert_unknown_source(tmp_path, capsys):
    code, text = run_cli(["convert", "--source", "onnx", "--out", str(tmp_path / "out")], capsys)
    _assert_clear(code, text, InputError.exit_code, ["onnx", "hf, gguf"])
    assert not (tmp_path / "out").exists()


def test_uneven_pp_for_tensorrt_llm_keeps_earlier_stages(tmp_path, capsys):
    """3 layers over pp=2 for an unknown TensorRT-LLM release: rejected at build, convert intact."""
    cfg = tiny_cfg(layers=3)
    make_hf_dir(tmp_path / "hf", cfg)
    recipe = ["--recipe", _tiny(tmp_path, backend="tensorrt-llm", kv="{dtype: fp16}"), "--set", "build.pp=2"]
    work = tmp_path / "work"
    code, text = run_cli(["build", *recipe, "--work-dir", str(work), "--until", "convert"], capsys)
    assert code == 0, text
    before = snapshot(work)
    code, text = run_cli(["build", *recipe, "--work-dir", str(work), "--until", "build"], capsys)
    _assert_clear(code, text, UnsupportedError.exit_code, ["build.pp", "3 layers", "pp=2", "[2, 1]",
                                                           "--set build.trtllm_version=0.21.0", "1, 3"])
    assert snapshot(work) == before  # no engines/ directory, convert untouched
    assert read_manifest(next((work / "models").iterdir()) / "convert")["stage"] == "convert"
