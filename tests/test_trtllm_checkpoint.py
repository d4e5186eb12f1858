"""Contract tests for the TensorRT-LLM checkpoint against shared/reference/trtllm.md.

Expected names and shapes are computed here from the §2.3 table, independently
of builder/trtllm/checkpoint.py; shards are reassembled and compared with the
source HF weights.
"""

from __future__ import annotations

import json
import math
import os
import stat

import pytest
import torch
from helpers_convert import make_hf_dir, tiny_cfg
from safetensors import safe_open

from builder.convert.hf import HFCheckpoint
from builder.trtllm import (
    export_hf_kv_scales,
    parse_kv_pool_log,
    run_trtllm_build,
    trtllm_build_command,
    write_trtllm_checkpoint,
)
from runtime.errors import ExternalToolMissing, InputError, StageError, UnsupportedError

CONFIGS = {  # name -> (heads, kv_heads, tied)
    "mha": (4, 4, False),
    "gqa": (8, 2, True),
}
PARALLEL = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    out = {}
    for name, (heads, kv, tied) in CONFIGS.items():
        d = tmp_path_factory.mktemp(name)
        cfg = tiny_cfg(heads=heads, kv_heads=kv, layers=3, vocab=97, tied=tied, hidden=32, inter=48, head_dim=8)
        out[name] = (d, cfg, make_hf_dir(d, cfg, seed=3, tokenizer=False))
    return out


def read(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def expected_rank_shapes(cfg, t, pp, pp_rank, kv_scale):
    """§2.3 per-rank shapes, written out from the table."""
    H, nh, nkv, d, I, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                           cfg.intermediate_size, cfg.vocab_size)
    per_stage = [len(x) for x in torch.arange(cfg.num_layers).tensor_split(pp)]
    shapes = {}
    if pp_rank == 0:
        shapes["transformer.vocab_embedding.weight"] = (V, H)
    for i in range(per_stage[pp_rank]):
        p = f"transformer.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "attention.qkv.weight"] = ((nh // t + 2 * math.ceil(nkv / t)) * d, H)
        shapes[p + "attention.dense.weight"] = (H, nh * d // t)
        shapes[p + "post_layernorm.weight"] = (H,)
        shapes[p + "mlp.fc.weight"] = (I // t, H)
        shapes[p + "mlp.gate.weight"] = (I // t, H)
        shapes[p + "mlp.proj.weight"] = (H, I // t)
        if kv_scale:
            shapes[p + "attention.kv_cache_scaling_factor"] = (1,)
    if pp_rank == pp - 1:
        shapes["transformer.ln_f.weight"] = (H,)
        shapes["lm_head.weight"] = (math.ceil(V / t) * t // t, H)
    return shapes


@pytest.mark.parametrize("tp,pp", PARALLEL)
@pytest.mark.parametrize("model", list(CONFIGS))
def test_shards_match_reference_table_and_reassemble_to_source(tmp_path, sources, model, tp, pp):
    src_dir, cfg, sd = sources[model]
    facts = write_trtllm_checkpoint(src_dir, tmp_path, "fp32", tp=tp, pp=pp, kv_dtype="int8",
                                    k_amax=torch.full((3,), 2.0), v_amax=torch.full((3,), 3.0))
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", *(f"rank{r}.safetensors" for r in range(tp * pp))])
    assert facts["files"] == [f"rank{r}.safetensors" for r in range(tp * pp)]
    ranks = {}
    for pp_rank in range(pp):
        for tp_rank in range(tp):
            shard = read(tmp_path / f"rank{pp_rank * tp + tp_rank}.safetensors")
            want = expected_rank_shapes(cfg, tp, pp, pp_rank, kv_scale=True)
            assert {k: tuple(v.shape) for k, v in shard.items()} == want
            assert all(v.dtype == torch.float32 for v in shard.values())
            ranks[pp_rank, tp_rank] = shard

    d, nh, nkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    kv_per_rank = math.ceil(nkv / tp) * d
    stages = [list(x.tolist()) for x in torch.arange(cfg.num_layers).tensor_split(pp)]
    for pp_rank, layers in enumerate(stages):
        for local, layer in enumerate(layers):
            p, hf = f"transformer.layers.{local}.", f"model.layers.{layer}."
            qkv = [ranks[pp_rank, r][p + "attention.qkv.weight"] for r in range(tp)]
            q = torch.cat([x[: nh // tp * d] for x in qkv])
            ks = [x[nh // tp * d: nh // tp * d + kv_per_rank] for x in qkv]
            vs = [x[nh // tp * d + kv_per_rank:] for x in qkv]
            if nkv < tp:  # duplicated heads: every copy equals its source head; keep one per head
                rep = tp // nkv
                for r in range(tp):
                    assert torch.equal(ks[r], ks[r - r % rep]) and torch.equal(vs[r], vs[r - r % rep])
                ks, vs = ks[::rep], vs[::rep]
            assert torch.equal(q, sd[hf + "self_attn.q_proj.weight"])
            assert torch.equal(torch.cat(ks), sd[hf + "self_attn.k_proj.weight"])
            assert torch.equal(torch.cat(vs), sd[hf + "self_attn.v_proj.weight"])

            def cat(name, dim, stage=pp_rank, prefix=p):
                return torch.cat([ranks[stage, r][prefix + name] for r in range(tp)], dim=dim)

            assert torch.equal(cat("attention.dense.weight", 1), sd[hf + "self_attn.o_proj.weight"])
            assert torch.equal(cat("mlp.fc.weight", 0), sd[hf + "mlp.gate_proj.weight"])  # fc <- gate_proj
            assert torch.equal(cat("mlp.gate.weight", 0), sd[hf + "mlp.up_proj.weight"])  # gate <- up_proj
            assert torch.equal(cat("mlp.proj.weight", 1), sd[hf + "mlp.down_proj.weight"])
            for r in range(tp):
                assert torch.equal(ranks[pp_rank, r][p + "input_layernorm.weight"], sd[hf + "input_layernorm.weight"])
                assert torch.equal(ranks[pp_rank, r][p + "post_layernorm.weight"],
                                   sd[hf + "post_attention_layernorm.weight"])
    for r in range(tp):
        assert torch.equal(ranks[0, r]["transformer.vocab_embedding.weight"], sd["model.embed_tokens.weight"])
        assert torch.equal(ranks[pp - 1, r]["transformer.ln_f.weight"], sd["model.norm.weight"])
    head = torch.cat([ranks[pp - 1, r]["lm_head.weight"] for r in range(tp)])
    V = cfg.vocab_size
    assert head.shape[0] % tp == 0 and head.shape[0] - V < tp
    src_head = sd["model.embed_tokens.weight"] if cfg.tie_word_embeddings else sd["lm_head.weight"]
    assert torch.equal(head[:V], src_head) and not head[V:].any()


def test_config_fields(tmp_path, sources):
    src_dir, cfg, _ = sources["gqa"]
    write_trtllm_checkpoint(src_dir, tmp_path, "bf16", tp=2, pp=1, kv_dtype="fp8",
                            k_amax=torch.ones(3), v_amax=torch.ones(3))
    c = json.loads((tmp_path / "config.json").read_text())
    assert c["architecture"] == "LlamaForCausalLM" and c["dtype"] == "bfloat16"
    assert (c["vocab_size"], c["hidden_size"], c["num_hidden_layers"]) == (97, 32, 3)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_size"], c["intermediate_size"]) == (8, 2, 8, 48)
    assert c["norm_epsilon"] == cfg.rms_norm_eps and c["rotary_base"] == cfg.rope_theta
    assert c["rotary_scaling"] is None and c["position_embedding_type"] == "rope_gpt_neox"
    assert c["hidden_act"] == "silu" and c["max_position_embeddings"] == 256
    assert {k: c["mapping"][k] for k in ("world_size", "tp_size", "pp_size")} == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    assert c["quantization"] == {"quant_algo": None, "kv_cache_quant_algo": "FP8"}
    assert read(tmp_path / "rank1.safetensors")["transformer.layers.0.attention.qkv.weight"].dtype == torch.bfloat16


def test_llama3_rope_scaling_reaches_rotary_scaling(tmp_path):
    from runtime.config import preset

    cfg = preset("tiny-llama3").replace(num_layers=1)
    make_hf_dir(tmp_path / "src", cfg, tokenizer=False)
    (tmp_path / "out").mkdir()
    write_trtllm_checkpoint(tmp_path / "src", tmp_path / "out", "fp16", tp=1)
    c = json.loads((tmp_path / "out" / "config.json").read_text())
    assert c["rotary_scaling"]["factor"] == 8.0 and c["rotary_scaling"]["type"] == "llama3"
    assert c["rotary_base"] == 500000.0 and c["quantization"]["kv_cache_quant_algo"] is None
    assert not any("kv_cache_scaling_factor" in k for k in read(tmp_path / "out" / "rank0.safetensors"))


K_AMAX = torch.tensor([10.0, 300.0, 1000.0])
V_AMAX = torch.tensor([30.0, 5.0, 2000.0])


@pytest.mark.parametrize("kv_dtype,qmax,clamp,expected", [
    ("int8", 127.0, False, [30 / 127, 300 / 127, 2000 / 127]),
    ("fp8", 448.0, False, [30 / 448, 300 / 448, 2000 / 448]),
    ("fp8", 448.0, True, [1.0, 1.0, 2000 / 448]),     # ModelOpt's clamp to >= 1
    ("int8", 127.0, True, [30 / 127, 300 / 127, 2000 / 127]),  # INT8 is never clamped
])
def test_kv_cache_scaling_factor_values(tmp_path, sources, kv_dtype, qmax, clamp, expected):
    src_dir, _, _ = sources["mha"]
    facts = write_trtllm_checkpoint(src_dir, tmp_path, "fp32", tp=2, pp=2, kv_dtype=kv_dtype,
                                    k_amax=K_AMAX, v_amax=V_AMAX, clamp_fp8_scales_to_one=clamp)
    got = []
    for rank_file, layers in (("rank0.safetensors", 2), ("rank2.safetensors", 1)):
        shard = read(tmp_path / rank_file)
        for i in range(layers):
            s = shard[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]
            assert s.dtype == torch.float32 and s.shape == (1,)
            got.append(float(s))
        other = read(tmp_path / rank_file.replace("0", "1").replace("2", "3"))  # tp peer holds the same scale
        assert all(torch.equal(other[k], shard[k]) for k in shard if k.endswith("scaling_factor"))
    assert got == pytest.approx(expected, rel=1e-6)
    assert facts["kv_cache_scaling_factor"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("kw,err,fragment", [
    ({"kv_dtype": "int4", "k_amax": K_AMAX, "v_amax": V_AMAX}, UnsupportedError, "INT4"),
    ({"kv_dtype": "fp8"}, InputError, "calibrat"),
    ({"kv_dtype": "int8", "k_amax": torch.ones(2), "v_amax": torch.ones(2)}, InputError, "[3]"),
    ({"tp": 3}, UnsupportedError, "tp 3"),
    ({"tp": 8}, UnsupportedError, "tp 8"),
])
def test_bad_requests(tmp_path, sources, kw, err, fragment):
    src_dir, _, _ = sources["mha"]
    with pytest.raises(err) as info:
        write_trtllm_checkpoint(src_dir, tmp_path, "fp32", **kw)
    assert fragment in str(info.value)


# ------------------------------------------------------------------ HF-layout scales
def test_export_hf_kv_scales(tmp_path, sources):
    src_dir, cfg, sd = sources["gqa"]
    out = tmp_path / "hf"
    out.mkdir()
    facts = export_hf_kv_scales(src_dir, out, "fp8", K_AMAX, V_AMAX)
    scales = read(out / "kv_scales.safetensors")
    for i in range(3):
        k = scales[f"model.layers.{i}.self_attn.k_proj.k_scale"]
        v = scales[f"model.layers.{i}.self_attn.v_proj.v_scale"]
        assert k.shape == () and k.dtype == torch.float32 and float(k) == pytest.approx(float(K_AMAX[i]) / 448)
        assert float(v) == pytest.approx(float(V_AMAX[i]) / 448)
    assert facts["k_scale"][2] == pytest.approx(1000 / 448)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.layers.0.self_attn.k_proj.k_scale"] == "kv_scales.safetensors"
    assert set(sd) <= set(index) and index["model.norm.weight"] == "model.safetensors"
    assert os.path.samefile(out / "model.safetensors", src_dir / "model.safetensors") or \
        (out / "model.safetensors").read_bytes() == (src_dir / "model.safetensors").read_bytes()
    hf_quant = json.loads((out / "hf_quant_config.json").read_text())
    assert hf_quant["quantization"]["kv_cache_quant_algo"] == "FP8"
    config = json.loads((out / "config.json").read_text())
    # Same quantization_config ModelOpt itself derives from this hf_quant_config.
    convert = pytest.importorskip("modelopt.torch.export.convert_hf_config")
    assert config["quantization_config"] == convert.convert_hf_quant_config_format(hf_quant)
    assert json.loads((src_dir / "config.json").read_text()).get("quantization_config") is None  # source untouched
    assert HFCheckpoint(out).cfg == cfg


def test_export_hf_kv_scales_rejects_int8(tmp_path, sources):
    with pytest.raises(UnsupportedError, match="FP8 only"):
        export_hf_kv_scales(sources["mha"][0], tmp_path, "int8", K_AMAX, V_AMAX)
    assert os.listdir(tmp_path) == []


# ------------------------------------------------------------------ trtllm-build
def test_build_command_line():
    cmd = trtllm_build_command("/ck", "/eng", {
        "max_batch_size": 64, "max_input_len": 2048, "max_seq_len": 4096, "max_num_tokens": 8192,
        "tokens_per_block": 32, "use_paged_context_fmha": False, "context_fmha": True,
        "gpt_attention_plugin": "auto"})
    assert cmd == ["trtllm-build", "--checkpoint_dir", "/ck", "--output_dir", "/eng",
                   "--max_batch_size", "64", "--max_input_len", "2048", "--max_seq_len", "4096",
                   "--max_num_tokens", "8192", "--tokens_per_block", "32", "--kv_cache_type", "paged",
                   "--gpt_attention_plugin", "auto",
                   "--use_paged_context_fmha", "disable", "--context_fmha", "enable"]
    # kvq's engine.json as it is: block_size is tokens_per_block, the memory fraction and the
    # embedded engine's CUDA graphs are runtime options
    engine_json = {"max_batch_size": 8, "max_input_len": 512, "max_seq_len": 1024, "max_num_tokens": 2048,
                   "block_size": 64, "gpu_memory_fraction": 0.9, "cuda_graphs": True}
    assert trtllm_build_command("/ck", "/eng", engine_json)[5:] == [
        "--max_batch_size", "8", "--max_input_len", "512", "--max_seq_len", "1024", "--max_num_tokens", "2048",
        "--tokens_per_block", "64", "--kv_cache_type", "paged"]
    with pytest.raises(InputError, match="twice"):
        trtllm_build_command("/ck", "/eng", {"block_size": 64, "tokens_per_block": 32})
    with pytest.raises(InputError, match="tp_size"):
        trtllm_build_command("/ck", "/eng", {"tp_size": 2})  # TP/PP come from the checkpoint
    with pytest.raises(InputError, match="true or false"):
        trtllm_build_command("/ck", "/eng", {"use_fp8_context_fmha": "yes"})


def test_run_build_without_tool_names_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    cmd = trtllm_build_command(tmp_path / "ck", tmp_path / "eng", {"max_batch_size": 8})
    with pytest.raises(ExternalToolMissing) as info:
        run_trtllm_build(cmd, tmp_path / "build.log")
    assert "trtllm-build --checkpoint_dir" in str(info.value) and "--max_batch_size 8" in str(info.value)
    assert ExternalToolMissing.exit_code not in (InputError.exit_code, UnsupportedError.exit_code, StageError.exit_code)


LOG = """[TensorRT-LLM][INFO] Memory usage when calculating max tokens in paged kv cache: total: 139.81 GiB, available: 120.50 GiB
[TensorRT-LLM][INFO] Number of blocks in KV cache primary pool: 13236
[TensorRT-LLM][INFO] Number of tokens per block: 32.
[TensorRT-LLM][INFO] [MemUsageChange] Allocated 108.45 GiB for max tokens in paged KV cache (423552).
[TensorRT-LLM][WARNING] Paged Context FMHA is disabled because it doesn't work with int8 kv cache currently.
"""


def test_parse_kv_pool_log():
    got = parse_kv_pool_log(LOG)
    assert got["kv_cache_gib"] == 108.45 and got["max_tokens"] == 423552
    assert got["blocks_primary"] == 13236 and got["tokens_per_block"] == 32
    assert got["memory_total_gib"] == 139.81 and got["memory_available_gib"] == 120.5
    assert len(got["feature_warnings"]) == 1
    newer = "Blocks per window size:\n[windowSize=4096] {.primaryBlocks=500, .secondayBlocks=0}\n"
    assert parse_kv_pool_log(newer)["blocks_per_window"] == {4096: {"primary": 500, "secondary": 0}}
    assert parse_kv_pool_log("nothing here") == {}


def _script(path, body):
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def test_run_build_keeps_log_and_reports_failure(tmp_path, monkeypatch):
    # A shell script named trtllm-build exercises only our subprocess plumbing
    # (log capture, parse, exit status); the real tool is covered by test_trtllm_real.py.
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    log_text = LOG.replace("\n", "\\n")
    _script(bindir / "trtllm-build", f'printf "{log_text}"; echo "args: $*" >&2\n')
    facts = run_trtllm_build(["trtllm-build", "--max_batch_size", "4"], tmp_path / "b.log")
    assert facts["kv_pool"]["max_tokens"] == 423552
    assert "args: --max_batch_size 4" in (tmp_path / "b.log").read_text()
    _script(bindir / "trtllm-build", 'echo "[E] out of memory"; exit 3\n')
    with pytest.raises(StageError, match="out of memory"):
        run_trtllm_build(["trtllm-build"], tmp_path / "c.log")


# ------------------------------------------------------ TensorRT-LLM's own code (contract)
@pytest.mark.parametrize("tp,pp", PARALLEL)
@pytest.mark.parametrize("model", list(CONFIGS))
def test_contract_every_rank_loads_like_from_checkpoint_and_matches_its_hf_converter(tmp_path, sources, model, tp, pp):
    """Loaded with upstream's config/Mapping/load rules; equal tensor for tensor to its HF converter's split."""
    from helpers_trtllm import from_checkpoint, hf_converter_rank

    src_dir, cfg, sd = sources[model]
    write_trtllm_checkpoint(src_dir, tmp_path, "fp32", tp=tp, pp=pp, kv_dtype="fp8",
                            k_amax=torch.full((3,), 2.0), v_amax=torch.full((3,), 3.0))
    c, ranks = from_checkpoint(tmp_path)
    assert (c["tp"], c["pp"], c["kv_algo"]) == (tp, pp, "FP8")
    for rank, weights in ranks.items():
        want = hf_converter_rank(sd, c, cfg.tie_word_embeddings, rank)
        assert set(want) == {k for k in weights if not k.endswith("kv_cache_scaling_factor")}
        for name, tensor in want.items():
            assert torch.equal(weights[name], tensor), f"rank {rank} {name}"
        scales = [k for k in weights if k.endswith("kv_cache_scaling_factor")]
        assert scales and all(weights[k].dtype == torch.float32 for k in scales)


def _recipe_ctx(tmp_path, *sets):
    from builder.pipeline import Context
    from recipes import load_recipe

    r = load_recipe("smollm2-135m-fp8kv", ["backend=tensorrt-llm", "kv.granularity=per_tensor", "kv.rotation=none",
                                           *sets])
    return Context(r, tmp_path)


@pytest.mark.parametrize("sets", [
    ("kv.dtype=fp8_e4m3", "model.dtype=bf16"),
    ("kv.dtype=int8", "model.dtype=fp16"),
    ("kv.dtype=fp16", "model.dtype=fp32"),
])
def test_contract_build_command_parses_with_trtllm_build_argparse(tmp_path, sets):
    from helpers_trtllm import parse_trtllm_build

    from builder.engine_build import trtllm_build_params

    ctx = _recipe_ctx(tmp_path, *[f"{s}" for s in sets])
    cmd = trtllm_build_command(tmp_path / "ck", tmp_path / "eng", trtllm_build_params(ctx))
    ns = parse_trtllm_build(cmd)
    dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[ctx.recipe.model.dtype]
    assert ns.gpt_attention_plugin == dtype  # a value every release's plugin options accept
    assert ns.kv_cache_type == "paged" and ns.tokens_per_block == ctx.recipe.build.block_size
    assert ns.use_paged_context_fmha == ("enable" if ctx.recipe.kv.dtype == "fp16" else "disable")


def test_contract_uneven_pp_split_matches_upstream_and_is_gated_by_version(monkeypatch):
    from helpers_trtllm import UPSTREAM, pp_layers

    from builder.trtllm import pp_split
    from builder.trtllm.checkpoint import pp_layer_ranges
    from builder.trtllm.pp_split import FIRST_MATCHING, check_pp_split

    for layers, pp in ((30, 4), (32, 3), (3, 2), (80, 8)):
        assert [list(r) for r in pp_layer_ranges(layers, pp)] == [pp_layers(layers, pp, s) for s in range(pp)]
    assert ".".join(map(str, FIRST_MATCHING)) == UPSTREAM["pp_layers_history"]["first_matching_release"]
    for target in (None, "0.20.0", "0.19.0.dev2025", "latest"):
        with pytest.raises(UnsupportedError) as info:
            check_pp_split(30, 4, target)
        msg = str(info.value)
        assert "build.pp" in msg and "[8, 8, 7, 7]" in msg and "floor division" in msg
        assert "--set build.trtllm_version=0.21.0" in msg and "1, 2, 3, 5, 6, 10, 15" in msg
    for target in ("0.21.0", "1.0.0rc4", "v1.2.0"):
        check_pp_split(30, 4, target)
    check_pp_split(32, 4, None)  # even splits agree in every release
    # The installed release builds the engine, so it wins over the recipe's target.
    monkeypatch.setattr(pp_split, "installed_trtllm_version", lambda: "0.20.0")
    assert pp_split.target_version("1.0.0") == ("0.20.0", "installed here")
    with pytest.raises(UnsupportedError, match=r"0\.20\.0 \(installed here\) is older than 0\.21"):
        check_pp_split(30, 4, *pp_split.target_version("1.0.0"))
