"""Our `max` calibration against a peer: NVIDIA ModelOpt's FP8 KV calibration on SmolLM2.

Same token batches into both; ModelOpt's per-layer k_bmm_quantizer / v_bmm_quantizer
amax (K after RoPE, V) must agree with our per-layer max within 1%, and our
fp8_e4m3 per_tensor scale must be that amax / 448.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import helpers_calibration as H  # noqa: E402

from calibration.calibrate import calibration_windows, run_calibration, scales_for  # noqa: E402
from calibration.peer_modelopt import modelopt_kv_amax  # noqa: E402
from runtime.config import ModelConfig  # noqa: E402
from runtime.kv_format import KVFormat  # noqa: E402

pytestmark = pytest.mark.slow
pytest.importorskip("modelopt.torch.quantization")


def test_per_layer_amax_agrees_with_modelopt(tmp_path):
    d = H.smollm2_dir()
    samples, seq = 8, 256
    run_calibration(d, tmp_path, num_samples=samples, seq_len=seq, policy="max", seed=5)
    windows, _ = calibration_windows(d, ModelConfig.from_dir(d), "builtin", samples, seq, 5)
    mo_k, mo_v = modelopt_kv_amax(H.smollm2_hf_model_fresh(), windows)
    k_scale, v_scale = scales_for(tmp_path, KVFormat("fp8_e4m3", "per_tensor"))
    ours_k, ours_v = k_scale * 448.0, v_scale * 448.0
    assert mo_k.shape == ours_k.shape == (30,)
    torch.testing.assert_close(ours_k, mo_k, rtol=0.01, atol=0)
    torch.testing.assert_close(ours_v, mo_v, rtol=0.01, atol=0)
