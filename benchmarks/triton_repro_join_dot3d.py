"""Triton 3.6 miscompile (sm_90, H200): a split/join identity feeding a batched 3D tl.dot.

    python3 benchmarks/triton_repro_join_dot3d.py      # GPU machine

Why it matters here: widening an 8-bit V tile *before* its shared-memory staging
(`dequant._operand`'s split/join of column pairs, CVT_EARLY) takes the per-warp decode
kernel from 692 to 452 instructions per fp8 tile (local sm_90 SASS: V through cp.async
like K, no byte-wise operand reads). On the H200 the result is wrong: relative error
1.7 for fp8 and int8, every stage count. This script shows the same on 20 lines: the
identity alone is exact; as the B operand of a [4, 16, 128] batched dot it is not,
while the plain cast (mode 0) is exact. Expected output on a fixed Triton: every
"rel err" below 1e-6. Found 2026-11-29; not yet reported upstream.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _widen(x, MODE: tl.constexpr):
    y = x.to(tl.float16)
    if MODE == 1:  # identity: split column pairs apart and join them back
        a, b = tl.split(tl.reshape(y, (y.shape[0], y.shape[1], y.shape[2] // 2, 2)))
        y = tl.reshape(tl.join(a, b), (y.shape[0], y.shape[1], y.shape[2]))
    return y


@triton.jit
def _identity(X, Y, W: tl.constexpr, R: tl.constexpr, C: tl.constexpr, MODE: tl.constexpr):
    o = tl.arange(0, W)[:, None, None] * R * C + tl.arange(0, R)[None, :, None] * C + tl.arange(0, C)[None, None, :]
    tl.store(Y + o, _widen(tl.load(X + o), MODE))


@triton.jit
def _batched_pv(X, P, Y, W: tl.constexpr, R: tl.constexpr, C: tl.constexpr, H: tl.constexpr, MODE: tl.constexpr):
    o = tl.arange(0, W)[:, None, None] * R * C + tl.arange(0, R)[None, :, None] * C + tl.arange(0, C)[None, None, :]
    po = tl.arange(0, W)[:, None, None] * H * R + tl.arange(0, H)[None, :, None] * R + tl.arange(0, R)[None, None, :]
    acc = tl.dot(tl.load(P + po).to(tl.float16), _widen(tl.load(X + o), MODE))
    oo = tl.arange(0, W)[:, None, None] * H * C + tl.arange(0, H)[None, :, None] * C + tl.arange(0, C)[None, None, :]
    tl.store(Y + oo, acc)


def main() -> None:
    torch.manual_seed(0)
    w, r, c, h = 4, 16, 128, 4
    for dt in (torch.float8_e4m3fn, torch.int8):
        x = (torch.randn(w, r, c, device="cuda") * 4).to(dt)
        p = torch.rand(w, h, r, device="cuda")
        ref = p.half().double() @ x.double()
        for mode in (0, 1):
            y = torch.empty(w, r, c, device="cuda", dtype=torch.float16)
            _identity[(1,)](x, y, w, r, c, mode, num_warps=4)
            out = torch.empty(w, h, c, device="cuda", dtype=torch.float32)
            _batched_pv[(1,)](x, p, out, w, r, c, h, mode, num_warps=4)
            print(f"{str(dt):22s} mode {mode}: identity max err {(y.double() - x.double()).abs().max().item():.1e}, "
                  f"batched dot rel err {((out.double() - ref).norm() / ref.norm()).item():.1e}", flush=True)


if __name__ == "__main__":
    main()
