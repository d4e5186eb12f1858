"""benchmarks/step_profile.py on the CPU with the tiny preset: the rows and the table it writes, the step
modes side by side, every component of a step measured, the burst's tokens equal to the legacy step's, and the
batch-invariant mode's tokens of a prompt alone equal to its tokens beside another."""

from __future__ import annotations

import json

import pytest

from benchmarks.step_profile import main

LEGACY = {"embed", "qkv_gemm", "o_gemm", "gate_up_gemm", "down_gemm", "kv_write", "attention", "lm_head", "norms",
          "rope", "residual_swiglu", "sampling"}


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("step_profile")
    main(["--device", "cpu", "--preset", "tiny", "--out", str(out), "--formats", "bf16", "--contexts", "40",
          "--max-ctx", "24", "--kv-gib", "0.001", "--max-batch", "6", "--block", "8", "--rounds", "1",
          "--warmup", "1", "--tokens", "3", "--reps", "4", "--burst", "2", "--check-tokens", "3",
          "--step", "legacy", "burst", "fused", "invariant", "--small-preset", "tiny", "--small-contexts", "16"])
    rows = [json.loads(line) for line in (out / "step_profile.jsonl").read_text().splitlines()]
    return rows, (out / "step_profile.md").read_text()


def test_every_scenario_has_each_mode_with_its_components(profile):
    rows, _ = profile
    assert rows[0]["kind"] == "env" and rows[0]["preset"] == "tiny-llama3"
    steps = [r for r in rows if r["kind"] == "step"]
    # batch 1 at 40 tokens, and as many 24-token sequences as the pool holds (capped at --max-batch)
    # and first the small geometry's batch 1 (the tiny preset again here), named by its preset
    assert {(r["scenario"], r["batch"]) for r in steps} == {("tiny-llama3 batch1@16", 1), ("batch1@40", 1),
                                                            ("max@24", 6)}
    assert {r["mode"] for r in steps} == {"legacy", "burst", "invariant"}  # fused needs CUDA
    for step in steps:
        mine = [r for r in rows if r["kind"] == "component" and
                (r["scenario"], r["mode"]) == (step["scenario"], step["mode"])]
        assert {r["component"] for r in mine} == LEGACY
        assert all(r["ms"] > 0 and r["bytes"] > 0 and 0 < r["bound_ms"] for r in mine)
        total = sum(r["ms"] for r in mine)
        assert step["components_ms"] == pytest.approx(total)
        assert step["unattributed_ms"] == pytest.approx(step["gpu_step_ms"] - total)
        assert step["host_ms"] >= 0 and step["gpu_step_ms"] + step["host_ms"] >= step["step_ms"] * (1 - 1e-9)
        assert step["tok_s"] == pytest.approx(step["batch"] / step["step_ms"] * 1e3)
        assert step["tokens_match"] is True
        bursts = step["mode"] != "legacy"  # the invariant mode's engine runs bursts too
        assert step["burst"] == (2 if bursts else 1)
        assert step["burst_share"] == (1.0 if bursts else 0.0)  # every timed step in bursts


def test_the_markdown_puts_the_modes_side_by_side(profile):
    _, md = profile
    assert "| legacy: step ms (GPU / host) |" in md and "| burst: tok/s |" in md and "| invariant: tok/s |" in md
    assert "| bf16 | batch1@40 |" in md and "| bf16 | max@24 | burst |" in md and "burst: yes" in md
    assert "| bf16 | max@24 | invariant |" in md and "invariant: yes" in md
    # batch-1 steps with what bounds them (no captured step to count kernels in on the CPU)
    bounds = md.split("What bounds a batch-1 step")[1].split("\n\n")[1]
    assert "| tiny-llama3 | bf16 | tiny-llama3 batch1@16 | legacy |" in bounds and "max@24" not in bounds
