"""Which TensorRT-LLM releases split layers over pipeline stages the way kvq does.

kvq writes rank files with `pp_layer_ranges` (torch.tensor_split: when pp does
not divide the layer count, the first `layers % pp` stages get one extra
layer). TensorRT-LLM's `Mapping.pp_layers` has done the same since commit
c8e062bfd3 (PR #4399, "Align PP layer distribution between pytorch and TRT
flow", 2025-05-20 on main, after the 0.20 release branch was cut). Before it,
the Python side used `num_layers // pp_size` layers per stage and the C++
runtime `mNbLayers / pipelineParallelism`, so an engine built by those
releases from an unevenly split checkpoint looks for layers in the wrong rank
file. With an even split every release agrees, so only uneven splits need a
known target version. tests/data/trtllm_upstream.json holds the facts.
"""

from __future__ import annotations

import re
from importlib import metadata

from runtime.errors import UnsupportedError

# First release whose pp_layers matches kvq's uneven split.
FIRST_MATCHING = (0, 21)


def installed_trtllm_version() -> str | None:
    try:
        return metadata.version("tensorrt-llm")
    except metadata.PackageNotFoundError:
        return None


def _release(version: str) -> tuple[int, int] | None:
    m = re.match(r"\s*v?(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else None


def stage_sizes(num_layers: int, pp: int) -> list[int]:
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def target_version(recipe_version: str | None) -> tuple[str | None, str]:
    """The release that will build the engine and where that is known from."""
    installed = installed_trtllm_version()
    if installed:
        return installed, "installed here"
    return recipe_version, "build.trtllm_version"


def check_pp_split(num_layers: int, pp: int, target: str | None, source: str = "build.trtllm_version") -> None:
    """Reject an uneven split unless `target` (a TensorRT-LLM version) is known to split like kvq."""
    if pp < 1 or num_layers % pp == 0:
        return
    release = _release(target) if target else None
    if release is not None and release >= FIRST_MATCHING:
        return
    divisors = [d for d in range(1, num_layers + 1) if num_layers % d == 0 and d <= 16]
    first = ".".join(map(str, FIRST_MATCHING))
    if release is not None:
        known = f"the target TensorRT-LLM {target} ({source}) is older than {first}"
    elif target:
        known = f"{source} {target!r} is not a version"
    else:
        known = "the target TensorRT-LLM version is not known (not installed here, no build.trtllm_version)"
    raise UnsupportedError(
        f"build.pp: {num_layers} layers do not split evenly over pp={pp}. kvq puts "
        f"{stage_sizes(num_layers, pp)} layers on the stages (extra layers on the first ones), as "
        f"TensorRT-LLM >= {first} does; older releases use floor division ({num_layers // pp} per stage) "
        f"and would load the wrong layers, and {known}.\n"
        f"  Choose a pp that divides {num_layers} ({', '.join(map(str, divisors))}), or, when the engine "
        f"will be built by TensorRT-LLM >= {first}, say so: --set build.trtllm_version={first}.0"
    )
