"""The skinny-matmul GEMV (runtime/kernels/skinny_gemm.py) against an fp64 oracle: odd M, N and K (masked
tails), bf16 / fp16; error within 2x torch's own at the same precision plus a floor; and its shape rule."""

from __future__ import annotations

import pytest
import torch
from helpers_kernels import DEV

from runtime.kernels import skinny_gemm


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 37, 300), (5, 64, 256), (16, 19, 513)])
def test_gemv_matches_fp64_within_torchs_error(dtype, m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype).to(DEV)
    got = skinny_gemm.gemv(x, w, block_n=16, block_k=64)
    ref = x.double() @ w.double().T
    torch_err = ((x @ w.T).double() - ref).abs().max()
    err = (got.double() - ref).abs().max()
    floor = torch.finfo(dtype).eps * ref.abs().max()
    assert got.shape == (m, n) and got.dtype == dtype
    assert err <= 2 * torch_err + floor, f"worst error {err:.3g} vs torch's {torch_err:.3g}"


def test_gemv_refuses_what_it_cannot_run():
    x = torch.zeros(17, 8, dtype=torch.bfloat16, device=DEV)
    with pytest.raises(ValueError, match="1..16"):
        skinny_gemm.gemv(x, torch.zeros(4, 8, dtype=torch.bfloat16, device=DEV))


def test_without_tuned_data_every_shape_runs_cublas():
    # no tuned file for this name: the rule keeps cuBLAS for every shape
    assert skinny_gemm.gemv_shapes("no such gpu") == {}
    from runtime.batch_invariant import fast_linear

    x, w = torch.randn(2, 8), torch.randn(4, 8)
    assert torch.equal(skinny_gemm.linear(x, w), fast_linear(x, w))
