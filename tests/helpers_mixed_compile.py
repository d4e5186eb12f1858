"""Cross-compile, for sm_90, every build the K/V-split and group-scale formats' ops launch on the H200 (decode at
Llama-3-8B 16 x 32768 with bf16 q, the write at 1024 tokens), and print one JSON line each: the launches
are recorded without a GPU (tests/helpers_launch_record.py), compiled by tests/helpers_sass_digest.py's
`compile_build`. The interpreter runs what the compiler refuses (a non-constexpr global read inside a @jit function,
a Gluon layout that does not fit), so this is the CPU check that the GPU builds exist. Run without TRITON_INTERPRET
(`python -m tests.helpers_mixed_compile`; tests/test_kernel_mixed.py runs it in a subprocess)."""

from __future__ import annotations

import json

import torch

from runtime.kv_format import KVFormat
from tests.helpers_launch_record import _cache, recording, write_launches

# The formats tests/test_kernel_mixed.py runs, and the group sizes of benchmarks/kernels.py (32, 64: head_dim 128)
COMPILED_FORMATS = [
    KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False),  # K8V4
    KVFormat("fp8_e4m3", "per_token", v_dtype="int4", v_symmetric=False),  # KFP8V4
    KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False, v_group_size=32),  # K8V4-g32 (bundled)
    KVFormat("int4", "per_token", False, group_size=64),
    KVFormat("int4", "per_token", False, group_size=32),
    KVFormat("int4", "per_token", True, group_size=64),
    KVFormat("int4", "per_token", True, group_size=32),
    KVFormat("int8", "per_token", True, group_size=64),
    KVFormat("int8", "per_token", False, "bfloat16", 64),
    KVFormat("int4", "per_token", False, "float32", 16),
    KVFormat("int4", "per_token", True, "e8m0", 16),
    KVFormat("int8", "per_token", True, "e8m0", 16),
    KVFormat("int4", "per_token", True, "e8m0", 32),
    KVFormat("fp8_e4m3", "per_token", True, "float16", 16),
    KVFormat("fp8_e5m2", "per_token", True, "bfloat16", 16),
    KVFormat("int4", "per_token", False, "float16", 16, "int8", True, 0),
]


def builds(fmt: KVFormat) -> list[tuple[str, dict]]:
    """(label, launch record) of every kernel launch of the format's decode and write on the H200."""
    out = []
    for launch in _decode(fmt, torch.bfloat16):  # fp16 q: the same code in another dtype
        out.append((f"{fmt.name} decode {launch['kernel']}", launch))
    for launch in write_launches(fmt, 8, 128, 1024, torch.bfloat16, "h200"):
        out.append((f"{fmt.name} write {launch['kernel']}", launch))
    return out


def _decode(fmt: KVFormat, q_dtype: torch.dtype) -> list[dict]:
    """decode_launches with the format object itself (the recorder's names cover the single formats only)."""
    import runtime.kernels as kernels

    dev = torch.device("cuda", 0)
    with recording("h200") as launches:
        cache = _cache(fmt, 16 * 2048, 16, 8, 128, dev)
        q = torch.empty(16, 32, 128, dtype=q_dtype, device=dev)
        bt = torch.empty(16, 2048, dtype=torch.int32, device=dev)
        kernels.decode_attention(q, cache, bt, torch.empty(16, dtype=torch.int32, device=dev), 0.088)
    return launches


def resources(compiled) -> dict:
    """Registers a thread, spill stack and shared memory of a compiled build (cuobjdump's resource usage)."""
    from tests.helpers_gluon_compile import cuobjdump, resource_usage

    return resource_usage(cuobjdump(compiled, "--dump-resource-usage")[0], compiled)


def main() -> None:
    from tests.helpers_sass_digest import compile_launch

    seen = set()
    for fmt in COMPILED_FORMATS:
        for label, launch in builds(fmt):
            key = json.dumps({k: v for k, v in launch.items() if k != "grid"}, sort_keys=True, default=str)
            if key in seen:
                continue
            seen.add(key)
            try:
                row = dict(ok=True, **resources(compile_launch(launch)))
            except Exception as e:  # that build's failure, reported; the others go on
                row = dict(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
            print(json.dumps(dict(build=label, **row)), flush=True)


if __name__ == "__main__":
    main()
