"""The kvq-build pipeline: manifests, skip-if-unchanged, --force, and atomic stages under SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers_cli import run_cli
from safetensors.torch import load_file

from builder.pipeline import read_manifest, require_manifest
from runtime.errors import StageError

pytestmark = pytest.mark.slow

RECIPE = "smollm2-135m-fp8kv"
# Small calibration so the stage takes seconds, but long enough to be killed in the middle.
# per_tensor: a format with calibrated scales (the bundled FP8 recipe's are per-token).
SETS = ["--set", "calibration.num_samples=12", "--set", "calibration.seq_len=256", "--set", "kv.granularity=per_tensor"]


def kvq_build(work: Path, *args: str, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "builder.cli", "build", "--recipe", RECIPE, "--work-dir", str(work), *SETS, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def finish(p: subprocess.Popen, timeout: float = 600) -> str:
    out, _ = p.communicate(timeout=timeout)
    assert p.returncode == 0, out
    return out


def stage_dirs(work: Path) -> dict[str, Path]:
    (model,) = (work / "models").iterdir()
    out = {"convert": model / "convert"}
    cal = [d for d in model.iterdir() if d.name.startswith("calibrate-") and not d.name.startswith(".")]
    if cal:
        out["calibrate"] = cal[0]
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """An uninterrupted run up to calibrate."""
    work = tmp_path_factory.mktemp("ref")
    finish(kvq_build(work, "--until", "calibrate"))
    return work


def same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(str(a)), load_file(str(b))
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def kill_when(p: subprocess.Popen, appears, timeout: float = 300) -> None:
    """SIGKILL the run as soon as `appears()` is true (the stage is mid-way)."""
    t0 = time.time()
    while not appears():
        assert p.poll() is None, "the run finished before it could be interrupted: " + (p.stdout.read() or "")
        assert time.time() - t0 < timeout
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(signal.SIGKILL)
    p.wait()


def test_manifests_and_skip_on_rerun(reference):
    dirs = stage_dirs(reference)
    conv = require_manifest(dirs["convert"], "convert")
    cal = require_manifest(dirs["calibrate"], "calibrate")
    for m in (conv, cal):
        assert {"stage", "recipe", "recipe_digest", "key_digest", "inputs", "versions", "outputs"} <= m.keys()
        assert m["versions"]["torch"]
    assert cal["inputs"]["convert"]  # the calibrate key names the convert manifest it read
    out = finish(kvq_build(reference, "--until", "calibrate"))
    assert out.count("up to date") == 2, out
    assert read_manifest(dirs["calibrate"])["created"] == cal["created"]
    with pytest.raises(StageError):
        require_manifest(dirs["convert"], "calibrate")


def test_force_redoes_only_that_stage(reference, tmp_path):
    work = tmp_path / "w"
    shutil.copytree(reference, work)
    dirs = stage_dirs(work)
    before_conv = read_manifest(dirs["convert"])["created"]
    before_cal = read_manifest(dirs["calibrate"])
    time.sleep(1.1)
    finish(kvq_build(work, "--until", "calibrate", "--force", "calibrate"))
    assert read_manifest(dirs["convert"])["created"] == before_conv
    after_cal = read_manifest(dirs["calibrate"])
    assert after_cal["created"] != before_cal["created"]
    assert after_cal["key_digest"] == before_cal["key_digest"]
    same_tensors(dirs["calibrate"] / "kv_scales.safetensors", stage_dirs(reference)["calibrate"] / "kv_scales.safetensors")


def test_sigkill_during_convert_then_rerun_equals_uninterrupted(reference, tmp_path):
    work = tmp_path / "w"
    p = kvq_build(work, "--until", "convert")
    models = work / "models"
    kill_when(p, lambda: models.is_dir() and any(models.glob("*/.convert.tmp-*/*")))
    # Nothing a later stage would accept: no convert directory with a manifest.
    conv = next(models.iterdir()) / "convert"
    assert read_manifest(conv) is None
    finish(kvq_build(work, "--until", "convert"))
    ref = stage_dirs(reference)["convert"]
    assert not list(conv.parent.glob(".convert.tmp-*"))  # the stale temp dir was cleaned
    same_tensors(conv / "model.safetensors", ref / "model.safetensors")
    assert json.loads((conv / "config.json").read_text()) == json.loads((ref / "config.json").read_text())
    assert read_manifest(conv)["outputs"] == read_manifest(ref)["outputs"]


def test_sigkill_during_calibrate_then_rerun_equals_uninterrupted(reference, tmp_path):
    work = tmp_path / "w"
    ref_dirs = stage_dirs(reference)
    model_dir = work / "models" / ref_dirs["convert"].parent.name
    model_dir.mkdir(parents=True)
    shutil.copytree(ref_dirs["convert"], model_dir / "convert")
    p = kvq_build(work, "--until", "calibrate")
    kill_when(p, lambda: any(model_dir.glob(".calibrate-*.tmp-*")))
    assert "calibrate" not in stage_dirs(work) or read_manifest(stage_dirs(work)["calibrate"]) is None
    out = finish(kvq_build(work, "--until", "calibrate"))
    assert "up to date" in out  # convert was complete and is reused
    cal = stage_dirs(work)["calibrate"]
    same_tensors(cal / "kv_scales.safetensors", ref_dirs["calibrate"] / "kv_scales.safetensors")
    assert not list(model_dir.glob(".calibrate-*.tmp-*"))


def test_dry_run_lists_stages_and_writes_nothing(tmp_path):
    env = dict(os.environ, COLUMNS="200")
    p = subprocess.run([sys.executable, "-m", "builder.cli", "build", "--recipe", RECIPE, "--work-dir",
                        str(tmp_path / "w"), "--dry-run"], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    for stage in ("convert", "calibrate", "build", "evaluate", "deploy", "compare"):
        assert stage in p.stdout
    assert "would run" in p.stdout and "engines/smollm2-135m-fp8kv/engine" in p.stdout
    assert not (tmp_path / "w").exists()


TINY_TRTLLM = """name: tiny-trtllm
backend: tensorrt-llm
model: {{source: hf, path: {path}, dtype: fp16}}
kv: {{dtype: fp8_e4m3, granularity: per_tensor}}
calibration: {{num_samples: 2, seq_len: 16}}
build: {{max_batch_size: 2, max_input_len: 64, max_seq_len: 128, tp: 2, block_size: 16}}
accuracy: {{enabled: false}}
deploy: {{enabled: false}}
"""


def test_contract_trtllm_handoff_names_final_paths_and_a_rerun_builds_once_trtllm_build_exists(
        tmp_path, monkeypatch, capsys):
    """A fake trtllm-build that takes exactly upstream's argparse and writes Engine.save's files."""
    from helpers_convert import make_hf_dir, tiny_cfg
    from helpers_trtllm import install_fake_trtllm_build

    make_hf_dir(tmp_path / "hf", tiny_cfg(heads=4, kv_heads=2, layers=2, vocab=97))
    recipe = tmp_path / "tiny-trtllm.yaml"
    recipe.write_text(TINY_TRTLLM.format(path=tmp_path / "hf"))
    work = tmp_path / "work"
    path = os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                           if not (Path(p) / "trtllm-build").exists())
    monkeypatch.setenv("PATH", path)
    args = ["build", "--recipe", str(recipe), "--work-dir", str(work), "--until", "build"]

    code, text = run_cli(args, capsys)
    assert code == 8, text
    engine = work / "engines" / "tiny-trtllm" / "engine"
    manifest = read_manifest(engine)
    cmd = manifest["outputs"]["trtllm_build_command"]
    assert cmd[cmd.index("--checkpoint_dir") + 1] == str(engine / "checkpoint")
    assert cmd[cmd.index("--output_dir") + 1] == str(engine / "trt_engine")
    assert (engine / "checkpoint" / "rank1.safetensors").is_file()
    assert " ".join(cmd) in " ".join(text.split()) and ".tmp-" not in text
    assert not [p for p in engine.parent.iterdir() if ".tmp-" in p.name]
    earlier = {d: read_manifest(d)["created"] for d in (work / "models").glob("*/*") if read_manifest(d)}
    assert len(earlier) == 2  # convert and calibrate
    code, text = run_cli([*args, "--dry-run"], capsys)
    assert code == 0 and "build      would run" in text  # a checkpoint without its engine is not done

    install_fake_trtllm_build(tmp_path / "bin")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{path}")
    code, text = run_cli(args, capsys)
    assert code == 0, text
    built = read_manifest(engine)
    assert built["outputs"]["engine_built"] is True and built["created"] >= manifest["created"]
    assert built["outputs"]["trtllm_build"]["command"] == cmd
    assert (engine / "trtllm-build.log").is_file() and built["outputs"]["trtllm_build"]["log"] == str(
        engine / "trtllm-build.log")
    assert sorted(p.name for p in (engine / "trt_engine").iterdir()) == ["config.json", "rank0.engine", "rank1.engine"]
    engine_cfg = json.loads((engine / "trt_engine" / "config.json").read_text())
    assert engine_cfg["pretrained_config"]["mapping"]["tp_size"] == 2
    assert engine_cfg["build_config"]["gpt_attention_plugin"] == "float16"
    assert {d: read_manifest(d)["created"] for d in earlier} == earlier  # reused, not redone

    code, text = run_cli(args, capsys)
    assert code == 0 and read_manifest(engine)["created"] == built["created"]  # now it is up to date
