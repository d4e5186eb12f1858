"""Cross-compile every planned build of the Gluon decode kernel for sm_90 and print one JSON line each (registers,
spill stack, local-memory instructions inside the tile loop, shared memory). Run without TRITON_INTERPRET
(`python -m tests.helpers_gluon_compile`; tests/test_kernel_gluon.py runs it in a subprocess); exit code 3 when
this Triton has no Gluon."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from runtime.kernels import decode_gluon
from runtime.kernels.formats import format_codes
from runtime.kernels.plan import DecodePlan, decode_plan
from runtime.kernels.tuned_file import DEVICE_H200, Device
from runtime.kv_format import KVFormat


def cuobjdump(compiled, *flags: str) -> list[str]:
    """cuobjdump's output for each flag, on a compiled build's cubin (the binary ships with Triton)."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return [subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout
                for flag in flags]


def resource_usage(usage: str, compiled) -> dict:
    """Registers a thread and spill stack from cuobjdump's resource usage, and the build's shared memory."""
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return dict(regs=regs, stack=stack, shared=compiled.metadata.shared)


# fp8 / int8 / int4 x per-tensor, per-head, per-token (+ asym)
FORMATS_BY_NAME = {f.name: f for f in [KVFormat(dtype, g) for dtype in ("fp8_e4m3", "int8", "int4")
                                       for g in ("per_tensor", "per_head", "per_token")]
                   + [KVFormat(dtype, "per_token", symmetric=False) for dtype in ("int8", "int4")]}
AMPERE = Device("NVIDIA A100", 108, 8)  # no TMA: the int4 ring filled by cp.async
PLAN_SHAPES = [(16, 8, 32768), (1, 8, 131072), (64, 1, 8192)]  # (batch, KV heads, context)


def planned(name: str, group: int, batch: int, kv_heads: int, ctx: int, device: Device = DEVICE_H200
            ) -> tuple[tuple, DecodePlan]:
    """(variant: format name, GQA group, ring stages, tiles two a step, TMA; the Gluon plan) for this shape."""
    plan = decode_plan(FORMATS_BY_NAME[name], batch, group * kv_heads, kv_heads, ctx, device, kernel="gluon")
    return (name, group, plan.stages, plan.pairs, plan.tma), plan


# Every format as planned on the H200 for long splits (int4: the ring filled by TMA, two tiles a step), for few long
# sequences (`tuning._long_splits`) and for short splits (int4 from registers), at GQA groups 4 (Llama-3-8B), 8
# (70B) and 1 (multi-head); fp8 per-token, whose register cap depends on the group (`tuning.FP8_TOKEN_CAP_GROUPS`),
# at every group; and the int4 rings filled by cp.async (sm_8x plans: one tile a step for per-head int4)
VARIANT_PLANS = dict(planned(name, group, *shape) for group in (4, 8, 1) for shape in PLAN_SHAPES
                     for name in FORMATS_BY_NAME)
VARIANT_PLANS.update(planned("fp8_e4m3-per_token", group, *PLAN_SHAPES[0]) for group in (2, 3, 5, 6, 7))
VARIANT_PLANS.update(planned(name, 4, *PLAN_SHAPES[0], AMPERE)
                     for name in ("int4-per_head", "int4-per_token", "int4-per_token-asym"))
GLUON_VARIANTS = list(VARIANT_PLANS)


def tma_signature(mode: int) -> dict[str, str]:
    """The kernel's argument types where the TMA unit copies (`gluon_tiles.ring_descriptors`): K, V (and per-token
    KS, VS, KZ, VZ) as tensor descriptors."""
    import torch
    from triton.runtime.jit import mangle_type

    pages = torch.zeros(16, 1, 16, 16, dtype=torch.int32)
    scales = (torch.zeros(16, 1, 16, dtype=torch.float16),) * 4 if mode == 3 else ()
    from runtime.kernels.gluon_tiles import ring_descriptors

    return dict(zip(("K", "V", "KS", "VS", "KZ", "VZ"), map(mangle_type, ring_descriptors(pages, pages, scales))))


# a SASS line: /*offset*/ [@predicate] OPCODE.modifiers ...; a branch: ... BRA target
_SASS_OP = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")
_SASS_BRANCH = re.compile(r"/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?BRA\s+(0x[0-9a-f]+)")


def tile_loop(sass: str) -> list[str]:
    """The opcodes (modifiers dropped) of a decode kernel's tile loop: the shortest backward branch's body that holds
    an mma (HMMA). (The longest one can be an out-of-line wait's branch back into the loop, spanning the epilogue.)"""
    ops = [(int(at, 16), op.split(".")[0]) for at, op in _SASS_OP.findall(sass)]
    loops = [(int(to, 16), int(at, 16)) for at, to in _SASS_BRANCH.findall(sass) if int(to, 16) < int(at, 16)]
    bodies = [[op for at, op in ops if start <= at <= end] for start, end in loops]
    bodies = [body for body in bodies if "HMMA" in body]
    if not bodies:
        raise ValueError("no loop with an mma in this SASS")
    return min(bodies, key=len)


def loop_local_accesses(sass: str) -> int:
    """LDL/STL instructions inside the tile loop (`tile_loop`): spills there cost every tile, a spill of a value kept
    across the loop costs once per program."""
    return sum(op in ("LDL", "STL") for op in tile_loop(sass))


def build(name: str, group: int, stages: int, pairs: bool, tma: bool) -> dict:
    from triton.experimental.gluon._runtime import GluonASTSource

    plan = VARIANT_PLANS[(name, group, stages, pairs, tma)]
    kf = format_codes(FORMATS_BY_NAME[name], decode_gluon.HEAD_DIM)
    mode, asym = kf.scale_mode, kf.asym
    fn = decode_gluon._decode_kernel_gluon
    scale = "*fp16" if mode == 3 else "*fp32"
    ptrs = {"Q": "*bf16", "K": "*i32", "V": "*i32", "KS": scale, "VS": scale, "KZ": scale, "VZ": scale,
            "BT": "*i32", "SEQ": "*i32", "OUT": "*bf16", "PM": "*fp32", "PL": "*fp32", "PACC": "*fp32"}
    if tma:  # as `launch._launch_gluon` passes them
        described = tma_signature(mode)
        ptrs.update(described if mode != 3 or asym else {**described, "KZ": described.get("KS", scale),
                                                           "VZ": described.get("VS", scale)})
    consts = dict(NUM_HEADS=8 * group, BLOCK_SIZE=16, GROUP=group, KIND=kf.kind, SCALE_MODE=mode, ASYM=asym,
                  **decode_gluon.widening(kf), SPLIT=True, SKIP_RESCALE=plan.skip_rescale, STAGES=stages,
                  OFF32=plan.offsets32, PAIRS=pairs, K_CHAINS=plan.k_chains, TMA=tma)
    consts.update({p.name: p.default for p in fn.params if p.is_constexpr and p.name not in consts})  # defaults
    names = fn.arg_names
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "fp32" if n == "qk_scale" else "i32") for n in names}
    aligned = [n for n in names if ptrs.get(n, "").startswith("*") or n.startswith("stride_") or n == "tokens_per_split"]
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    cap = plan.registers
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=1, **({"maxnreg": cap} if cap else {})))
    usage, sass = cuobjdump(compiled, "--dump-resource-usage", "-sass")
    return dict(cap=cap, **resource_usage(usage, compiled), loop_local=loop_local_accesses(sass))


def main() -> None:
    if decode_gluon.gluon is None:
        print("this Triton has no Gluon")
        sys.exit(3)
    for variant in GLUON_VARIANTS:
        try:
            row = build(*variant)
        except Exception as e:  # report it as that variant's failure, go on
            row = dict(error=f"{type(e).__name__}: {str(e)[-2000:]}")
        print(json.dumps(dict(variant=list(variant), **row)), flush=True)


if __name__ == "__main__":
    main()
