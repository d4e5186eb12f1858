"""Cross-compile every variant of the Gluon decode kernel for sm_90 and print one JSON line each
(registers, spill stack, local-memory instructions inside the tile loop, shared memory). Run without TRITON_INTERPRET (tests/test_kernels.py runs it
in a subprocess); exit code 3 when this Triton has no Gluon."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from runtime.kernels import decode_gluon, tuning  # noqa: E402
from runtime.kernels.formats import FP8_E4M3, KernelFormat  # noqa: E402


def kernel_format_of(kind: int, mode: int, asym: bool = False) -> KernelFormat:
    return KernelFormat(kind=kind, scale_mode=mode, asym=asym, fp8=FP8_E4M3 if kind == 0 else 0, qmax=0.0, qmin=0.0,
                        scale_dtype=0, head_dim=decode_gluon.HEAD_DIM)


def planned_build(kind: int, mode: int, asym: bool, group: int, batch: int, kv_heads: int,
                  ctx: int) -> tuple[int, int, bool, int, bool, int, int]:
    """The variant (ring stages, tiles two a step, what the TMA unit copies) `tuning.gluon_plan` takes for this
    format and shape on the H200."""
    kf = kernel_format_of(kind, mode, asym)
    tma = tuning.gluon_tma_for(kf, 9)
    _, _, stages, pairs = tuning.gluon_plan(kf, batch, kv_heads, ctx, 132, group=group, tma=tma)
    return kind, mode, asym, stages, pairs, group, tma if stages else 0


# (storage kind, scale mode, asymmetric, ring stages, tiles two a step, query heads per KV head, TMA copies): fp8 /
# int8 / int4 x
# per-tensor, per-head, per-token (+ asym), as planned for long splits (int4: the ring filled by TMA, two tiles a
# step), for few long sequences (`tuning._long_splits`) and for short splits (int4 from registers), at GQA groups 4
# (Llama-3-8B), 8 (70B) and 1 (multi-head); fp8 per-token, whose register cap depends on the group
# (`tuning.FP8_TOKEN_CAP_GROUPS`), at every group; and the int4 rings filled by cp.async (Ampere's), one tile a step
# for per-head int4
FORMATS = [(kind, mode, asym) for kind in (0, 1, 2)
           for mode, asym in ((1, False), (2, False), (3, False)) + (((3, True),) if kind else ())]
PLAN_SHAPES = [(16, 8, 32768), (1, 8, 131072), (64, 1, 8192)]  # (batch, KV heads, context)
GLUON_VARIANTS = list(dict.fromkeys(planned_build(*fmt, group, *shape)
                                    for group in (4, 8, 1) for shape in PLAN_SHAPES for fmt in FORMATS))
GLUON_VARIANTS += [planned_build(0, 3, False, group, *PLAN_SHAPES[0]) for group in (2, 3, 5, 6, 7)]
GLUON_VARIANTS += [(2, 1, False, 2, False, 4, 0), (2, 3, False, 4, True, 4, 0), (2, 3, True, 4, True, 4, 0),
                   (2, 3, True, 4, True, 4, 1)]


def tma_signature(mode: int) -> dict[str, str]:
    """The kernel's argument types where the TMA unit copies (`decode_gluon.ring_descriptors`): K, V (and per-token
    KS, VS, KZ, VZ) as tensor descriptors."""
    import torch
    from triton.runtime.jit import mangle_type

    pages = torch.zeros(16, 1, 16, 16, dtype=torch.int32)
    scales = (torch.zeros(16, 1, 16, dtype=torch.float16),) * 4 if mode == 3 else ()
    return dict(zip(("K", "V", "KS", "VS", "KZ", "VZ"), map(mangle_type, decode_gluon.ring_descriptors(pages, pages,
                                                                                                        scales))))


def loop_local_accesses(sass: str) -> int:
    """LDL/STL instructions inside the kernel's longest loop (the tile loop): spills there cost every
    tile, a spill of a value kept across the loop costs once per program."""
    addr = [(int(m.group(1), 16), line) for line in sass.splitlines() if (m := re.search(r"/\*([0-9a-f]{4})\*/", line))]
    loops = [(int(m.group(1), 16), a) for a, line in addr if (m := re.search(r"BRA (0x[0-9a-f]+)", line))
             and int(m.group(1), 16) < a]
    start, end = max(loops, key=lambda r: r[1] - r[0])
    return sum(1 for a, line in addr if start <= a <= end and re.search(r"\b(LDL|STL)\b", line))


def build(kind: int, mode: int, asym: bool, stages: int, pairs: bool, group: int, tma: int) -> dict:
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = decode_gluon._decode_kernel_gluon
    scale = "*fp16" if mode == 3 else "*fp32"
    ptrs = {"Q": "*bf16", "K": "*i32", "V": "*i32", "KS": scale, "VS": scale, "KZ": scale, "VZ": scale,
            "BT": "*i32", "SEQ": "*i32", "OUT": "*bf16", "PM": "*fp32", "PL": "*fp32", "PACC": "*fp32"}
    if tma:  # as `decode_gluon.launch` passes them
        described = tma_signature(mode if tma == 2 else 0)
        ptrs.update(described if mode != 3 or asym else {**described, "KZ": described.get("KS", scale),
                                                           "VZ": described.get("VS", scale)})
    kf = kernel_format_of(kind, mode, asym)
    consts = dict(NUM_HEADS=8 * group, BLOCK_SIZE=16, GROUP=group, KIND=kind, SCALE_MODE=mode, ASYM=asym,
                  **decode_gluon.widening(kf), SPLIT=True, SKIP_RESCALE=tuning.skip_rescale_for(kf),
                  STAGES=stages, OFF32=tuning.gluon_offsets32(kf, 0), PAIRS=pairs, K_CHAINS=tuning.gluon_k_chains_for(kf),
                  TMA=tma)
    names = fn.arg_names
    sig = {n: ptrs.get(n) or ("constexpr" if n in consts else "fp32" if n == "qk_scale" else "i32") for n in names}
    aligned = [n for n in names if ptrs.get(n, "").startswith("*") or n.startswith("stride_") or n == "tokens_per_split"]
    src = GluonASTSource(fn, sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                         attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    cap, _ = tuning.gluon_registers(kf, ring=stages > 0, group=group)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=1, **({"maxnreg": cap} if cap else {})))
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = (int(re.search(rf"{key}:(\d+)", usage).group(1)) for key in ("REG", "STACK"))
    return dict(cap=cap, regs=regs, stack=stack, loop_local=loop_local_accesses(sass), shared=compiled.metadata.shared)


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
