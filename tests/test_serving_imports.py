"""The served path imports neither sklearn nor scipy, nor transformers' generation package that pulls them in.

Why it matters: the Triton python backend's stub needs numpy < 2, so on a GPU image with numpy 2 the
serving code runs with numpy 1.26 first on the path, and that image's scipy (numpy 2 only) fails to
import. transformers' AutoTokenizer imports `transformers.generation`, which on some transformers
versions imports sklearn and so scipy: with it the preprocessing model did not start there. Here a
subprocess makes every import of sklearn and scipy fail (as on that image), imports every module the
served run uses, starts the real preprocessing and postprocessing models' `initialize`, loads an
engine's tokenizer the way kvq_engine does, and tokenizes with and without the chat template; the ids
must equal AutoTokenizer's (computed in this process, where nothing is blocked). A control run proves
the check would catch AutoTokenizer on the served path.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import helpers_calibration as H
import pytest
from helpers_triton import ENGINE_JSON

ROOT = Path(__file__).resolve().parents[1]
TEXT = "Hello world, ünïcode 日本 and the capital of France"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]

SCRIPT = r'''
import importlib.abc, importlib.machinery, importlib.util, json, sys

BLOCKED = ("sklearn", "scipy")


class _Refuse(importlib.abc.Loader):
    def create_module(self, spec):
        raise ImportError(f"{spec.name} cannot be imported here (the GPU image's scipy needs numpy 2)")

    def exec_module(self, module):
        pass


class _Block(importlib.abc.MetaPathFinder):
    # found (so availability probes say "installed", as on the GPU image), but importing it fails
    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, _Refuse()) if name.split(".")[0] in BLOCKED else None


sys.meta_path.insert(0, _Block())
root, backend_utils, engine_dir, mode = sys.argv[1:5]
sys.path[:0] = [root, backend_utils]


def model(name):
    spec = importlib.util.spec_from_file_location(f"served_{name}", f"{root}/triton_repo/models/{name}.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m.TritonPythonModel()


cfg = lambda **p: {"model_config": json.dumps(  # noqa: E731
    {"max_batch_size": 0, "parameters": {k: {"string_value": v} for k, v in p.items()}})}
out = {}
if mode == "control":
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(engine_dir)
else:
    import benchmarks.served_vs_inprocess  # noqa: F401  (the GPU benchmark's own process)
    import builder.loadgen  # noqa: F401
    import calibration.calibrate  # noqa: F401  (the benchmark's static scales for synthetic engines)
    import recipes.schema  # noqa: F401  (the benchmark reads kv.layers)
    import runtime.tokenizer
    import triton_repo.bench  # noqa: F401
    import triton_repo.openai_api.app  # noqa: F401
    import triton_repo.openai_api.runner as runner
    import triton_repo.server  # noqa: F401
    from runtime.engine import Engine
    from triton_repo import protocol

    assert runner.load_fast_tokenizer is runtime.tokenizer.load_fast_tokenizer
    pre, post = model("preprocessing"), model("postprocessing")
    pre.initialize(cfg(tokenizer_dir=engine_dir, max_input_len="64"))
    post.initialize(cfg(tokenizer_dir=engine_dir))
    text, messages = sys.argv[5], json.loads(sys.argv[6])
    engine = Engine.from_dir(engine_dir, device="cpu")  # as kvq_engine's initialize loads it
    try:
        out = {
            "plain": protocol.encode_prompt(pre.tokenizer, text, False),
            "chat": protocol.encode_prompt(pre.tokenizer, messages[0]["content"], True),
            "template": pre.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
            "engine": engine.tokenizer(text)["input_ids"],
            "decoded": post.tokenizer.decode(engine.tokenizer(text)["input_ids"], skip_special_tokens=True),
        }
    finally:
        engine.shutdown()
loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED or m.startswith("transformers.generation"))
print(json.dumps({"loaded": loaded, **out}))
'''


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory) -> Path:
    """A small random Llama with SmolLM2's real tokenizer (chat template included) and engine.json."""
    d = tmp_path_factory.mktemp("served-imports") / "engine"
    shutil.copytree(H.tiny_model_dir(), d)
    (d / "engine.json").write_text(json.dumps(ENGINE_JSON))
    return d


def _run(engine_dir: Path, mode: str) -> subprocess.CompletedProcess:
    import pytriton

    backend_utils = Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python"
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(ROOT), str(backend_utils), str(engine_dir), mode, TEXT,
         json.dumps(MESSAGES)], capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_served_modules_load_tokenizers_without_sklearn_or_scipy(engine_dir):
    from transformers import AutoTokenizer

    from triton_repo import protocol

    proc = _run(engine_dir, "served")
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["loaded"] == [], f"the served path imported {got['loaded']}"
    ref = AutoTokenizer.from_pretrained(str(engine_dir))
    assert got["plain"] == protocol.encode_prompt(ref, TEXT, False)
    assert got["engine"] == ref(TEXT)["input_ids"]
    assert got["template"] == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>" in got["template"]  # the chat template was loaded, not a plain concatenation
    assert got["chat"] == protocol.encode_prompt(ref, MESSAGES[0]["content"], True)
    assert got["decoded"] == ref.decode(ref(TEXT)["input_ids"], skip_special_tokens=True)


def test_the_check_catches_autotokenizer(engine_dir):
    """AutoTokenizer imports transformers.generation (the path to sklearn/scipy): the check above sees it."""
    proc = _run(engine_dir, "control")
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])["loaded"] if proc.returncode == 0 else ["failed"]
    assert loaded, "AutoTokenizer imported neither transformers.generation nor sklearn/scipy: the check proves nothing"
