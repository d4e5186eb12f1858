"""Recipes: bundled ones resolve; bad input gives a short error naming the field and the fix,
a non-zero exit code, and writes nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.cli import main
from recipes import bundled_names, load_recipe
from runtime.errors import RecipeError

EXPECTED_BUNDLED = {
    f"{family}-{kv}kv"
    for family in ("llama70b", "llama3-8b", "smollm2-135m", "synthetic-8b")
    for kv in ("fp16", "fp8", "int8", "int4")
}


def run_cli(args, tmp_path, capsys):
    """Run `kvq ARGS` in-process with cwd=tmp_path; return (exit code, stderr)."""
    old = os.getcwd()
    os.chdir(tmp_path)
    try:
        with pytest.raises(SystemExit) as e:
            main(list(args))
            raise SystemExit(0)
    finally:
        os.chdir(old)
    return e.value.code, capsys.readouterr().err


def test_bundled_recipes_all_resolve():
    assert EXPECTED_BUNDLED <= set(bundled_names())
    for name in bundled_names():
        r = load_recipe(name)
        assert r.name == name
    r = load_recipe("llama70b-int4kv")
    assert r.backend == "torch" and r.kv.dtype == "int4"  # TensorRT-LLM has no INT4 KV
    g = load_recipe("llama70b-fp8kv").geometry()
    assert (g.num_layers, g.num_heads, g.num_kv_heads, g.head_dim, g.hidden_size, g.intermediate_size,
            g.vocab_size) == (80, 64, 8, 128, 8192, 28672, 128256)


def test_extends_and_set_overrides():
    r = load_recipe("smollm2-135m-int8kv", ["build.max_batch_size=3", "kv.granularity=per_head"])
    assert r.kv.dtype == "int8" and r.kv.granularity == "per_head"
    assert r.build.max_batch_size == 3
    assert r.model.source == "builtin"  # inherited from smollm2-135m-fp16kv
    assert load_recipe("smollm2-135m-fp16kv", ["accuracy.passkey_lengths=[64, 128]"]).accuracy.passkey_lengths == [64, 128]


def test_recipe_from_path_with_relative_extends(tmp_path):
    (tmp_path / "base.yaml").write_text("backend: torch\nmodel: {source: builtin, preset: smollm2-135m}\n")
    (tmp_path / "mine.yaml").write_text("extends: base.yaml\nkv: {dtype: int8, granularity: per_token}\n")
    r = load_recipe(str(tmp_path / "mine.yaml"))
    assert r.name == "mine" and r.kv.dtype == "int8" and r.model.preset == "smollm2-135m"


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


BASE = "backend: torch\nmodel: {source: builtin, preset: smollm2-135m}\n"

# (description, argv builder, words the message must contain)
BAD = [
    ("unknown top-level key", lambda t: ["recipes", "show", _write(t, "a.yaml", BASE + "colour: red\n")],
     ["colour", "unknown field"]),
    ("unknown nested key", lambda t: ["recipes", "show", _write(t, "b.yaml", BASE + "kv: {dtyp: int8}\n")],
     ["kv.dtyp", "unknown field"]),
    ("unknown deep key via --set", lambda t: ["recipes", "show", "smollm2-135m-fp8kv", "--set", "build.tp_size=2"],
     ["build.tp_size", "unknown field"]),
    ("wrong type", lambda t: ["recipes", "show", "smollm2-135m-fp8kv", "--set", "build.max_batch_size=lots"],
     ["build.max_batch_size", "integer"]),
    ("unknown kv dtype", lambda t: ["recipes", "show", "smollm2-135m-fp8kv", "--set", "kv.dtype=int3"],
     ["kv.dtype", "int3"]),
    ("unknown recipe name", lambda t: ["recipes", "show", "llama71b-fp8kv"], ["unknown recipe", "kvq recipes list"]),
    ("missing recipe file", lambda t: ["recipes", "show", str(t / "nope.yaml")], ["does not exist"]),
    ("extends cycle", lambda t: ["recipes", "show", _write(t, "c1.yaml", "extends: c2.yaml\n")
                                 and _write(t, "c2.yaml", "extends: c1.yaml\n") and str(t / "c1.yaml")],
     ["cycle"]),
    ("--set without =", lambda t: ["recipes", "show", "smollm2-135m-fp8kv", "--set", "kv.dtype"], ["KEY.PATH=VALUE"]),
    ("--set into a value", lambda t: ["recipes", "show", "smollm2-135m-fp8kv", "--set", "kv.dtype.bits=4"],
     ["kv.dtype", "not a section"]),
    ("int4 with tensorrt-llm", lambda t: ["recipes", "show", "llama70b-fp8kv", "--set", "kv.dtype=int4"],
     ["no INT4", "backend: torch"]),
    ("per_head with tensorrt-llm", lambda t: ["recipes", "show", "llama70b-int8kv", "--set", "kv.granularity=per_head"],
     ["per_tensor", "backend: torch"]),
    ("tp not dividing heads", lambda t: ["plan", "--recipe", "llama70b-fp8kv", "--set", "build.tp=3"],
     ["build.tp", "divide", "64"]),
    ("max_input_len > max_seq_len", lambda t: ["recipes", "show", "smollm2-135m-fp8kv", "--set",
                                               "build.max_input_len=9000"], ["max_input_len", "max_seq_len"]),
    ("asymmetric fp8", lambda t: ["recipes", "show", "smollm2-135m-fp8kv", "--set", "kv.symmetric=false"],
     ["asymmetric", "symmetric: true"]),
    ("hf source without path", lambda t: ["recipes", "show", _write(t, "d.yaml", "model: {source: hf}\n")],
     ["model.path", "--set model.path"]),
    ("unknown preset", lambda t: ["plan", "--recipe", "smollm2-135m-fp8kv", "--set", "model.preset=gpt5"],
     ["model.preset", "gpt5"]),
    ("not a mapping", lambda t: ["recipes", "show", _write(t, "e.yaml", "- just\n- a list\n")], ["mapping"]),
    ("invalid YAML", lambda t: ["recipes", "show", _write(t, "f.yaml", "kv: {dtype: [int8\n")], ["not valid YAML"]),
    ("bad --context", lambda t: ["plan", "--recipe", "llama70b-fp8kv", "--context", "8k"], ["--context"]),
    ("bad --gpu-memory", lambda t: ["plan", "--recipe", "llama70b-fp8kv", "--gpu-memory", "lots"], ["141GB"]),
    ("torch backend with a tp its KV heads cannot take", lambda t: ["recipes", "show", "smollm2-135m-fp8kv",
                                                                    "--set", "build.tp=4"],
     ["build.tp", "tp 4 is not a multiple of num_key_value_heads 3"]),
    ("unknown --force stage", lambda t: ["build", "--recipe", "smollm2-135m-fp8kv", "--force", "bake",
                                         "--work-dir", str(t / "work")], ["bake", "unknown stage"]),
    ("llama70b without weights", lambda t: ["build", "--recipe", "llama70b-fp8kv", "--work-dir", str(t / "work")],
     ["Llama-3.1-70B-Instruct", "--set model.path", "kvq plan --recipe llama70b-fp8kv"]),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input_is_a_short_clear_error_and_writes_nothing(case, tmp_path, capsys):
    _, argv, words = case
    workspace = tmp_path / "ws"
    workspace.mkdir()
    args = argv(tmp_path)
    before = set(tmp_path.rglob("*"))
    code, err = run_cli(args, workspace, capsys)
    assert code not in (0, None), err
    assert "Traceback" not in err
    for w in words:
        assert w in err, f"{w!r} not in: {err}"
    assert len(err.splitlines()) <= 6, err
    assert set(tmp_path.rglob("*")) == before  # nothing written, not even the work dir


def test_error_exit_code_and_no_traceback_in_a_real_process(tmp_path):
    p = subprocess.run([sys.executable, "-m", "builder.cli", "recipes", "show", "nope-recipe"],
                       capture_output=True, text=True, cwd=tmp_path)
    assert p.returncode == RecipeError.exit_code
    assert "unknown recipe 'nope-recipe'" in p.stderr and "Traceback" not in p.stderr


def test_kvq_debug_shows_the_traceback(tmp_path):
    env = dict(os.environ, KVQ_DEBUG="1")
    p = subprocess.run([sys.executable, "-m", "builder.cli", "recipes", "show", "nope-recipe"],
                       capture_output=True, text=True, cwd=tmp_path, env=env)
    assert p.returncode != 0 and "Traceback" in p.stderr


@pytest.mark.slow
def test_bundled_recipes_found_after_a_non_editable_install(tmp_path):
    root = Path(__file__).resolve().parents[1]
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(target), str(root)], check=True, capture_output=True)
    code = "import recipes, sys; print(recipes.__file__); print(len(recipes.bundled_names()))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env=dict(os.environ, PYTHONPATH=str(target)), check=True)
    path, count = p.stdout.split()
    assert path.startswith(str(target)) and int(count) >= 16
