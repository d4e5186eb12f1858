"""The `trtllm-build` command line, its runner, and the KV-pool log parser.

trtllm.md §3.4: TP/PP come from the checkpoint's mapping, not from flags;
plugin switches take the strings `enable`/`disable`, never bare flags; the KV
dtype and scales come from the checkpoint. Only the flags below are emitted,
so an unknown recipe key is an error here rather than a flag the installed
trtllm-build may reject (or silently ignore).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

from runtime.errors import ExternalToolMissing, InputError, StageError

TOOL = "trtllm-build"
# value flags: build_params key -> converter to the command-line string
_VALUE_FLAGS = {
    "max_batch_size": int, "max_input_len": int, "max_seq_len": int, "max_num_tokens": int,
    "max_beam_width": int, "tokens_per_block": int, "workers": int,
    "kv_cache_type": str, "gpt_attention_plugin": str, "gemm_plugin": str, "log_level": str,
}
# plugin switches: bool in the recipe -> "enable"/"disable"
_SWITCHES = ("use_paged_context_fmha", "use_fp8_context_fmha", "context_fmha", "remove_input_padding",
             "use_fused_mlp", "multiple_profiles")
_KV_CACHE_TYPES = ("paged", "continuous", "disabled")
# kvq's engine.json name -> trtllm-build's name for the same setting
_ALIASES = {"block_size": "tokens_per_block"}
# engine.json settings that are runtime options, not build flags: the KV pool
# fraction goes to the Triton config (kv_cache_free_gpu_mem_fraction, trtllm.md §5.3);
# cuda_graphs is the embedded engine's (TensorRT-LLM's own cuda_graph_mode is left at its default).
RUNTIME_ONLY = ("gpu_memory_fraction", "cuda_graphs")


def trtllm_build_available() -> bool:
    return shutil.which(TOOL) is not None


def trtllm_build_command(checkpoint_dir: str | Path, engine_dir: str | Path, build_params: dict[str, Any]) -> list[str]:
    """argv for trtllm-build; `kv_cache_type` defaults to paged.

    Accepts kvq's engine.json settings as they are: `block_size` means
    `tokens_per_block`, and runtime-only settings (RUNTIME_ONLY) are not flags.
    """
    params: dict[str, Any] = {"kv_cache_type": "paged"}
    for key, value in build_params.items():
        if key in RUNTIME_ONLY:
            continue
        name = _ALIASES.get(key, key)
        if name in params and name != "kv_cache_type" and params[name] != value:
            raise InputError(f"build parameters give {name} twice with different values "
                             f"({params[name]!r} and {value!r} via {key}); keep one.")
        params[name] = value
    unknown = sorted(set(params) - set(_VALUE_FLAGS) - set(_SWITCHES))
    if unknown:
        raise InputError(f"unknown trtllm-build parameter(s) {', '.join(unknown)}; known: "
                         f"{', '.join(sorted([*_VALUE_FLAGS, *_SWITCHES, *_ALIASES, *RUNTIME_ONLY]))}.")
    if params["kv_cache_type"] not in _KV_CACHE_TYPES:
        raise InputError(f"kv_cache_type {params['kv_cache_type']!r} is not one of {', '.join(_KV_CACHE_TYPES)}.")
    cmd = [TOOL, "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir)]
    for key, conv in _VALUE_FLAGS.items():
        if params.get(key) is not None:
            try:
                value = conv(params[key])
            except (TypeError, ValueError):
                raise InputError(f"trtllm-build parameter {key}={params[key]!r} is not a {conv.__name__}.") from None
            cmd += [f"--{key}", str(value)]
    for key in _SWITCHES:
        if params.get(key) is not None:
            if not isinstance(params[key], bool):
                raise InputError(f"trtllm-build switch {key} must be true or false, got {params[key]!r}.")
            cmd += [f"--{key}", "enable" if params[key] else "disable"]
    return cmd


# §4.2: the C++ cache manager's lines (older and newer spellings).
_KV_PATTERNS = {
    "kv_cache_gib": (r"Allocated ([0-9.]+) GiB for max tokens in paged KV cache \((\d+)\)", float),
    "blocks_primary": (r"Number of blocks in KV cache primary pool: (\d+)", int),
    "tokens_per_block": (r"Number of tokens per block: (\d+)", int),
    "memory_total_gib": (r"Memory usage when calculating max tokens in paged kv cache: total: ([0-9.]+) GiB", float),
    "memory_available_gib": (r"calculating max tokens in paged kv cache: total: [0-9.]+ GiB, available: ([0-9.]+) GiB", float),
}


def parse_kv_pool_log(text: str) -> dict[str, Any]:
    """KV pool facts from a TensorRT-LLM log (last occurrence wins); {} when none are present."""
    out: dict[str, Any] = {}
    for key, (pattern, conv) in _KV_PATTERNS.items():
        found = re.findall(pattern, text)
        if found:
            last = found[-1]
            if key == "kv_cache_gib":
                out["kv_cache_gib"], out["max_tokens"] = float(last[0]), int(last[1])
            else:
                out[key] = conv(last)
    windows = re.findall(r"\[windowSize=(\d+)\]\s*\{\.primaryBlocks=(\d+),\s*\.secondayBlocks=(\d+)\}", text)
    if windows:
        out["blocks_per_window"] = {int(w): {"primary": int(p), "secondary": int(s)} for w, p, s in windows}
        out.setdefault("blocks_primary", sum(int(p) for _, p, _ in windows))
    # The builder's silent feature toggles (§1.6) show up only as warnings.
    toggles = [ln.strip() for ln in text.splitlines()
               if re.search(r"context[ _]fmha|kv cache reuse|chunked context", ln, re.IGNORECASE)
               and re.search(r"\[W\]|WARN|disabl", ln)]
    if toggles:
        out["feature_warnings"] = toggles
    return out


def run_trtllm_build(cmd: list[str], log_path: str | Path) -> dict[str, Any]:
    """Run trtllm-build, keeping its combined output in `log_path`; returns manifest facts.

    Raises ExternalToolMissing (its own exit code) with the exact command line
    when trtllm-build is not installed here, and StageError with the log's tail
    when it fails.
    """
    exe = shutil.which(cmd[0])
    if exe is None:  # callers check trtllm_build_available() first when a missing tool is not an error
        raise ExternalToolMissing(
            f"{cmd[0]} is not installed on this machine; the TensorRT-LLM checkpoint is complete. "
            f"On a machine with TensorRT-LLM, run:\n  {shlex.join(cmd)}"
        )
    log_path = Path(log_path)
    start = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run([exe, *cmd[1:]], stdout=log, stderr=subprocess.STDOUT, check=False)
    seconds = time.monotonic() - start
    text = log_path.read_text(errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-30:])
        raise StageError(f"{cmd[0]} failed with exit code {proc.returncode} (full log: {log_path}):\n{tail}")
    return {"command": cmd, "returncode": 0, "seconds": round(seconds, 2), "log": str(log_path),
            "kv_pool": parse_kv_pool_log(text)}
