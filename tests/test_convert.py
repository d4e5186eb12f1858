"""The convert stage: HF/GGUF/builtin/synthetic sources, streaming writer, bad input."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from helpers_convert import make_hf_dir, tiny_cfg
from safetensors import safe_open

from builder.atomic import atomic_dir
from builder.convert import convert_source
from builder.convert.builtin import builtin_gguf_path
from builder.convert.writer import StreamingSafetensorsWriter, TensorSpec, write_streaming
from runtime.config import ModelConfig
from runtime.errors import InputError, UnsupportedError


def read_all(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# ------------------------------------------------------------------ writer
def test_streaming_writer_reads_back_with_safetensors(tmp_path):
    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(6, dtype=torch.int32).reshape(2, 3),
        "d": torch.randn(2, 2).to(torch.float8_e4m3fn),
        "e": torch.tensor([1.5], dtype=torch.float16),
    }
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    n = write_streaming(tmp_path / "x.safetensors", specs, lambda s: tensors[s.name], metadata={"k": "v"})
    assert n == sum(t.numel() * t.element_size() for t in tensors.values())
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        assert list(f.keys()) == sorted(tensors)
        for k, v in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and torch.equal(got.view(torch.uint8), v.view(torch.uint8))
    # data starts 8-byte aligned, as the format asks
    raw = (tmp_path / "x.safetensors").read_bytes()
    assert struct.unpack("<Q", raw[:8])[0] % 8 == 0


def test_streaming_writer_casts_in_slices(tmp_path, monkeypatch):
    from builder.convert import writer

    monkeypatch.setattr(writer, "CHUNK_BYTES", 100)  # many slices, one not a multiple of the row size
    src = torch.randn(7, 13)
    write_streaming(tmp_path / "x.safetensors", [TensorSpec("w", (7, 13), torch.bfloat16)], lambda s: src)
    assert torch.equal(read_all(tmp_path / "x.safetensors")["w"], src.to(torch.bfloat16))
    with pytest.raises(ValueError, match="announced"):  # integers are never silently converted
        write_streaming(tmp_path / "y.safetensors", [TensorSpec("w", (2,), torch.float32)],
                        lambda s: torch.ones(2, dtype=torch.int32))


def test_streaming_writer_rejects_wrong_order_shape_and_incomplete(tmp_path):
    specs = [TensorSpec("a", (2,), torch.float32), TensorSpec("b", (3,), torch.float32)]
    p = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="expected tensor a"), StreamingSafetensorsWriter(p, specs) as w:
        w.write("b", torch.zeros(3))
    assert not p.exists()
    with pytest.raises(ValueError, match="announced"), StreamingSafetensorsWriter(p, specs) as w:
        w.write("a", torch.zeros(3))
    assert not p.exists()
    with pytest.raises(ValueError, match="closed before"), StreamingSafetensorsWriter(p, specs) as w:
        w.write("a", torch.zeros(2))
    assert not p.exists()


# ------------------------------------------------------------------ HF dirs
@pytest.mark.parametrize("shards,tied", [(1, False), (3, True)])
def test_hf_round_trip_equals_source(tmp_path, shards, tied):
    cfg = tiny_cfg(heads=4, kv_heads=2, tied=tied)
    src = make_hf_dir(tmp_path / "src", cfg, seed=1, shards=shards)
    out = tmp_path / "out"
    with atomic_dir(out) as tmp:
        facts = convert_source("hf", str(tmp_path / "src"), tmp, "fp32")
    got = read_all(out / "model.safetensors")
    assert set(got) == set(src)
    for k in src:
        assert torch.equal(got[k], src[k]), k
    assert ("lm_head.weight" in got) is (not tied)
    assert ModelConfig.from_dir(out) == cfg
    assert facts["num_tensors"] == len(src)
    assert facts["weight_bytes"] == sum(t.numel() * 4 for t in src.values())
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(str(out)).convert_tokens_to_ids("w5") == 5


def test_hf_cast_to_bf16_and_transformers_loads_it(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = tiny_cfg(heads=4, kv_heads=1)
    src = make_hf_dir(tmp_path / "src", cfg, seed=2, shards=2)
    convert_source("hf", str(tmp_path / "src"), tmp_path, "bf16")
    got = read_all(tmp_path / "model.safetensors")
    for k in src:
        assert got[k].dtype == torch.bfloat16 and torch.equal(got[k], src[k].to(torch.bfloat16)), k
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
    assert torch.equal(model.model.layers[1].self_attn.k_proj.weight, got["model.layers.1.self_attn.k_proj.weight"].float())


# ------------------------------------------------------------------ GGUF
@pytest.fixture(scope="module")
def smollm2_converted():
    # The session-wide conversion other test files share; it is convert_source's
    # output here because this module imports builder.convert at the top.
    from helpers_calibration import smollm2_dir

    return smollm2_dir()


@pytest.mark.slow
def test_builtin_smollm2_config_matches_reference(smollm2_converted):
    out = smollm2_converted
    cfg = ModelConfig.from_dir(out)
    # environment.md's numbers for SmolLM2-135M-Instruct
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size) == (576, 1536, 49152)
    assert cfg.rope_theta == 1e5 and cfg.max_position_embeddings == 8192 and cfg.rms_norm_eps == 1e-5
    assert cfg.tie_word_embeddings and (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    assert len(read_all(out / "model.safetensors")) == 2 + 30 * 9  # embed, norm, 9 per layer; no lm_head
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template and "im_start" in tok.chat_template
    assert tok.eos_token_id == 2


@pytest.mark.slow
def test_builtin_smollm2_weights_equal_transformers_gguf_loading(smollm2_converted):
    from helpers_calibration import smollm2_hf_model  # transformers' own GGUF loading, shared

    out = smollm2_converted
    ref = smollm2_hf_model()
    ref_sd = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied
    got = read_all(out / "model.safetensors")
    assert set(got) == set(ref_sd)
    for k, v in ref_sd.items():
        assert torch.equal(got[k], v), f"{k}: max diff {(got[k] - v).abs().max()}"


@pytest.mark.slow
def test_truncated_gguf_is_input_error(tmp_path):
    with open(builtin_gguf_path("smollm2-135m"), "rb") as f:
        (tmp_path / "bad.gguf").write_bytes(f.read(2_000_000))
    with pytest.raises(InputError, match="bad.gguf"), atomic_dir(tmp_path / "out") as tmp:
        convert_source("gguf", str(tmp_path / "bad.gguf"), tmp, "bf16")
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]


# ------------------------------------------------------------------ synthetic
def test_synthetic_writes_config_and_seed_only(tmp_path):
    facts = convert_source("synthetic:llama3-70b", None, tmp_path, "bf16", seed=7)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "synthetic.json"]
    assert json.loads((tmp_path / "synthetic.json").read_text()) == {"seed": 7}
    cfg = ModelConfig.from_dir(tmp_path)
    assert (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) == (80, 8, 128)
    assert facts["weight_bytes"] == 0 and facts["num_parameters"] > 70e9


# ------------------------------------------------------------------ bad input
def _truncate(d: Path):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _corrupt_header(d: Path):
    f = d / "model.safetensors"
    raw = bytearray(f.read_bytes())
    raw[8:20] = b"{not json!!!"
    f.write_bytes(bytes(raw))


def _arch(name: str, model_type: str):
    def edit(d: Path):
        c = json.loads((d / "config.json").read_text())
        c.update(architectures=[name], model_type=model_type)
        (d / "config.json").write_text(json.dumps(c))
    return edit


def _rewrite(d: Path, fn):
    from safetensors.torch import save_file

    sd = read_all(d / "model.safetensors")
    fn(sd)
    save_file(sd, str(d / "model.safetensors"))


BAD = {
    "missing dir": (lambda d: __import__("shutil").rmtree(d), InputError, ["src"]),
    "missing config": (lambda d: (d / "config.json").unlink(), InputError, ["config.json"]),
    "truncated": (_truncate, InputError, ["model.safetensors", "truncated"]),
    "corrupt header": (_corrupt_header, InputError, ["model.safetensors"]),
    "mistral": (_arch("MistralForCausalLM", "mistral"), UnsupportedError, ["config.json", "MistralForCausalLM"]),
    "gpt2": (_arch("GPT2LMHeadModel", "gpt2"), UnsupportedError, ["config.json", "GPT2LMHeadModel"]),
    "shape mismatch": (lambda d: _rewrite(d, lambda sd: sd.update(
        {"model.layers.1.mlp.up_proj.weight": torch.zeros(40, 32)})),
        InputError, ["model.safetensors", "model.layers.1.mlp.up_proj.weight", "[40, 32]"]),
    "missing tensor": (lambda d: _rewrite(d, lambda sd: sd.pop("model.layers.0.self_attn.v_proj.weight")),
                       InputError, ["model.safetensors", "model.layers.0.self_attn.v_proj.weight", "missing"]),
    "bin only": (lambda d: ((d / "model.safetensors").rename(d / "pytorch_model.bin")),
                 UnsupportedError, ["*.bin", "unpickle"]),
    "no tokenizer": (lambda d: (d / "tokenizer.json").unlink(), InputError, ["tokenizer"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_hf_input_clear_error_and_no_output(tmp_path, case):
    edit, err, fragments = BAD[case]
    src = tmp_path / "src"
    make_hf_dir(src, tiny_cfg())
    edit(src)
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(err) as info, atomic_dir(tmp_path / "out") as tmp:
        convert_source("hf", str(src), tmp, "bf16")
    for frag in fragments:
        assert frag in str(info.value), (frag, str(info.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no output, no temp dir left


def test_cli_maps_error_to_exit_code_without_traceback(tmp_path, capsys):
    from builder.cli import main

    with pytest.raises(SystemExit) as info:
        main(["convert", "--source", "hf", "--path", str(tmp_path / "nope"), "--out", str(tmp_path / "o")])
    assert info.value.code == InputError.exit_code
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()


def test_cli_convert_writes_directory(tmp_path):
    from builder.cli import main

    make_hf_dir(tmp_path / "src", tiny_cfg())
    main(["convert", "--source", "hf", "--path", str(tmp_path / "src"), "--out", str(tmp_path / "o")])
    assert {"config.json", "model.safetensors", "manifest.json", "tokenizer.json"} <= {
        p.name for p in (tmp_path / "o").iterdir()}
