"""Calibration on the real SmolLM2-135M (slow: loads the model)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import helpers_calibration as H  # noqa: E402

from calibration.calibrate import calibration_windows, collect_stats  # noqa: E402
from runtime.config import ModelConfig  # noqa: E402

pytestmark = pytest.mark.slow


def test_layer_streaming_gives_the_same_statistics_as_whole_model():
    d = H.smollm2_dir()
    w, _ = calibration_windows(d, ModelConfig.from_dir(d), "builtin", 4, 128, 0)
    whole = collect_stats(d, w, streaming=False)
    stream = collect_stats(d, w, streaming=True)
    assert torch.equal(whole.channel_amax, stream.channel_amax)
    assert torch.equal(whole.hist, stream.hist)
    assert torch.equal(whole.tokens, torch.full((30,), 4 * 128))
    # environment.md: K amax 10-21 per layer, V amax from ~0.6 (layer 0) up to ~16
    k, v = whole.layer_amax().unbind(-1)
    assert 5 < float(k.min()) and float(k.max()) < 40
    assert float(v[0]) < 2 and float(v.max()) > 5
