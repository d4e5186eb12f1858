"""Our TensorRT-LLM checkpoints, loaded by TensorRT-LLM itself.

Runs only where `tensorrt_llm` imports (it cannot be installed on kvq's CI
machines; see shared/design.md); the engine build additionally needs
`trtllm-build` on PATH and a CUDA device. The format contract is covered
everywhere by test_trtllm_checkpoint.py.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

tensorrt_llm = pytest.importorskip("tensorrt_llm")

from helpers_convert import make_hf_dir, tiny_cfg  # noqa: E402  (after the importorskip)

from builder.trtllm import run_trtllm_build, trtllm_build_command, write_trtllm_checkpoint  # noqa: E402

pytestmark = pytest.mark.trtllm


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("src")
    make_hf_dir(d, tiny_cfg(heads=8, kv_heads=2, layers=4, vocab=97, hidden=64, inter=128, head_dim=8),
                seed=5, tokenizer=False)
    return d


@pytest.mark.parametrize("tp,pp,kv", [(1, 1, None), (2, 2, "int8"), (4, 1, "fp8")])
def test_tensorrt_llm_loads_every_rank(tmp_path, source, tp, pp, kv):
    from tensorrt_llm.models import LLaMAForCausalLM

    amax = torch.linspace(1.0, 40.0, 4)
    write_trtllm_checkpoint(source, tmp_path, "fp16", tp=tp, pp=pp, kv_dtype=kv,
                            k_amax=amax if kv else None, v_amax=amax if kv else None)
    for rank in range(tp * pp):
        # from_checkpoint builds the rank's network and loads the shard; it
        # raises on a missing, unexpected or mis-shaped tensor.
        model = LLaMAForCausalLM.from_checkpoint(str(tmp_path), rank=rank)
        cfg = model.config
        assert (cfg.mapping.tp_size, cfg.mapping.pp_size, cfg.mapping.rank) == (tp, pp, rank)
        assert cfg.num_key_value_heads == 2 and cfg.head_size == 8
        assert cfg.quant_mode.has_int8_kv_cache() == (kv == "int8")
        assert cfg.quant_mode.has_fp8_kv_cache() == (kv == "fp8")
        params = dict(model.named_parameters())
        with safe_open(str(tmp_path / f"rank{rank}.safetensors"), framework="pt") as f:
            for name in f.keys():
                ours = f.get_tensor(name).float().numpy()
                theirs = np.asarray(params[name].raw_value, dtype=np.float32)
                assert theirs.shape == ours.shape and np.array_equal(theirs, ours), name


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("trtllm-build") is None or not torch.cuda.is_available(),
                    reason="needs trtllm-build and a CUDA device")
def test_trtllm_build_makes_an_engine(tmp_path, source):
    ckpt, engine = tmp_path / "ckpt", tmp_path / "engine"
    ckpt.mkdir()
    write_trtllm_checkpoint(source, ckpt, "fp16", tp=1, kv_dtype="fp8",
                            k_amax=torch.full((4,), 8.0), v_amax=torch.full((4,), 4.0))
    cmd = trtllm_build_command(ckpt, engine, {"max_batch_size": 4, "max_input_len": 64, "max_seq_len": 128,
                                              "max_num_tokens": 256, "tokens_per_block": 32})
    facts = run_trtllm_build(cmd, tmp_path / "build.log")
    assert (engine / "rank0.engine").is_file() and (engine / "config.json").is_file()
    assert facts["returncode"] == 0
