"""The decode-attention implementations benchmarks/peers.py compares, one function each.

Every function takes a `PagedCase` (q, block tables, sequence lengths, softmax scale: peers.py)
and the kvq `LayerCache` holding its K/V, and returns (call, detail): `call()` runs one decode
step and returns out [B, H, D] in q's dtype; `detail` names the kernel variant that ran. All of
them read the same cache tensors in place: kvq's pool layout `[pages, kv_heads, page, head_dim]`
is what FlashInfer and XQA call HND. An FP8 cache carries one per-tensor scale `s` shared by K
and V (x = q * s), because XQA takes a single `kv_scale`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from runtime.kv_cache import LayerCache

Call = Callable[[], torch.Tensor]
XQA_PAGE_SIZES = (16, 32, 64, 128)  # flashinfer/jit/xqa.py rejects any other page size
WORKSPACE_BYTES = 256 << 20  # split-K partials of FlashInfer and XQA; 256 MiB is FlashInfer's own test size


def kvq_decode(case, cache: LayerCache, scale: float | None) -> tuple[Call, str]:
    """kvq's public decode op with its default plan (the one the engine runs)."""
    from runtime.kernels import decode_attention

    return partial(decode_attention, case.q, cache, case.block_tables, case.seq_lens, case.sm_scale), "default plan"


def _page_ranges(case, page: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR page table: indptr [B + 1], page indices, tokens in each last page."""
    n_pages = (case.seq_lens + page - 1) // page
    used = torch.arange(case.block_tables.shape[1], device=case.q.device)[None, :] < n_pages[:, None]
    indptr = torch.zeros(len(n_pages) + 1, dtype=torch.int32, device=case.q.device)
    indptr[1:] = torch.cumsum(n_pages, 0)
    last = ((case.seq_lens - 1) % page + 1).to(torch.int32)
    return indptr, case.block_tables[used].to(torch.int32), last


def flashinfer_decode(case, cache: LayerCache, scale: float | None) -> tuple[Call, str]:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper: plan once (outside the timing), then run."""
    import flashinfer

    b, h, d = case.q.shape
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=case.q.device)
    # Tensor cores: FlashInfer's recommendation for GQA groups of 4 and more (its prefill kernels)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "HND", use_tensor_cores=True)
    indptr, indices, last = _page_ranges(case, cache.block_size)
    wrapper.plan(indptr, indices, last, h, cache.kv_heads, d, cache.block_size, q_data_type=case.q.dtype,
                 kv_data_type=cache.k.dtype, sm_scale=case.sm_scale)
    out = torch.full_like(case.q, float("nan"))
    scales = {} if scale is None else {"k_scale": scale, "v_scale": scale}
    run = partial(wrapper.run, case.q, (cache.k, cache.v), out=out, **scales)
    return run, f"tensor cores, backend {getattr(wrapper, '_backend', '?')}"


def xqa_decode(case, cache: LayerCache, scale: float | None) -> tuple[Call, str]:
    """TensorRT-LLM's XQA decode kernel as flashinfer.xqa ships it."""
    from flashinfer.xqa import xqa

    if cache.block_size not in XQA_PAGE_SIZES:
        raise ValueError(f"XQA takes pages of {XQA_PAGE_SIZES} tokens, not {cache.block_size}")
    b, h, d = case.q.shape
    dev = case.q.device
    out = torch.full((b, 1, h, d), float("nan"), dtype=case.q.dtype, device=dev)
    n_seq = b * cache.kv_heads
    # the count flashinfer's tests/attention/test_xqa.py allocates: round_up(n, 2) + 2 + n + 2
    semaphores = torch.zeros(n_seq + n_seq % 2 + n_seq + 4, dtype=torch.uint32, device=dev)
    workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    seq_lens = case.seq_lens.view(torch.uint32).view(b, 1)  # non-negative int32: the same bits
    kv_scale = 1.0 if scale is None else scale
    # XQA's logits are q.k * q_scale * kv_scale / sqrt(head_dim)
    run = partial(xqa, case.q.view(b, 1, h, d), cache.k, cache.v, case.block_tables, seq_lens, out, workspace,
                  semaphores, cache.kv_heads, cache.block_size, q_scale=case.sm_scale * math.sqrt(d),
                  kv_scale=kv_scale, kv_layout="HND")
    fp8_mma = cache.k.dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(dev)[0] == 9
    return (lambda: (run(), out.view(b, h, d))[1]), "sm90 FP8 MMA kernel (q, P in e4m3)" if fp8_mma else "mha kernel"


def dense_sdpa(case) -> tuple[Call, str]:
    """The common baseline: torch SDPA on dense BF16 K/V of the same shape, cuDNN backend on CUDA
    (flash where cuDNN refuses the shape; PyTorch's default on the CPU). The query heads of one
    KV head are its query rows, so no K/V is repeated."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, d = case.q.shape
    kvh = case.kv_heads
    k = case.k_src.view(b, -1, kvh, d).transpose(1, 2).contiguous()
    v = case.v_src.view(b, -1, kvh, d).transpose(1, 2).contiguous()
    q = case.q.view(b, kvh, h // kvh, d)

    def call() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, scale=case.sm_scale).view(b, h, d)

    if not case.q.is_cuda:
        return call, "default"
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION):
        def with_backend(backend=backend) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return call()
        try:
            with_backend()
            return with_backend, backend.name
        except RuntimeError as e:  # this backend refuses the shape: say so, try the next
            print(f"  SDPA {backend.name} unavailable: {str(e)[:120]}", flush=True)
    raise RuntimeError("neither cuDNN nor flash SDPA runs this shape")


IMPLEMENTATIONS: dict[str, Callable[..., tuple[Call, str]]] = {
    "kvq": kvq_decode, "flashinfer": flashinfer_decode, "xqa": xqa_decode,
}
LABELS = {"kvq": "kvq", "flashinfer": "FlashInfer", "xqa": "TensorRT-LLM XQA", "cudnn": "cuDNN BF16"}


def _module_builds(impl: str, q_dtype: torch.dtype, kv_dtypes: list[torch.dtype], page: int,
                   dims_and_groups: list[tuple[int, int]]) -> list[Callable[[], object]]:
    """The JIT builds `impl` needs for these formats, head dims and GQA groups, as calls that build and load."""
    if impl == "xqa":
        from flashinfer.xqa import get_xqa_module

        return [partial(get_xqa_module, q_dtype, kv, page, d, g, False, q_dtype, 1)
                for kv in kv_dtypes for d, g in dims_and_groups]
    if impl == "flashinfer":
        from flashinfer.prefill import get_batch_prefill_module

        # the arguments BatchDecodeWithPagedKVCacheWrapper.plan passes with tensor cores and a bf16 query
        # (FlashInfer's FA3 path needs an FP8 query for FP8 KV, so both formats take FA2)
        return [partial(get_batch_prefill_module, "fa2", q_dtype, kv, q_dtype, torch.int32, d, d, 0, False, False,
                        False) for kv in kv_dtypes for d in sorted({d for d, _ in dims_and_groups})]
    return []


def compile_peers(impls: list[str], q_dtype: torch.dtype, kv_dtypes: list[torch.dtype], page: int,
                  dims_and_groups: list[tuple[int, int]]) -> dict[str, str]:
    """JIT-build every FlashInfer/XQA module the run needs at once, in threads (each build is an nvcc
    job of its own; one after another they take minutes). Returns {impl: error} for what failed."""
    from concurrent.futures import ThreadPoolExecutor

    failed: dict[str, str] = {}
    jobs: list[tuple[str, Callable[[], object]]] = []
    for impl in impls:
        try:
            jobs += [(impl, job) for job in _module_builds(impl, q_dtype, kv_dtypes, page, dims_and_groups)]
        except ImportError as e:  # flashinfer not installed: that implementation's rows say so
            failed[impl] = f"ImportError: {e}"
    with ThreadPoolExecutor(max_workers=8) as pool:
        futures = [(impl, pool.submit(job)) for impl, job in jobs]
        for impl, fut in futures:
            try:
                fut.result()
            except Exception as e:  # the impl's rows record it; the others still run
                failed[impl] = f"{type(e).__name__}: {str(e)[:300]}"
    return failed
