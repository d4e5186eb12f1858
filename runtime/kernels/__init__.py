"""Triton-language (and Gluon) GPU kernels for the paged, quantized KV cache.

What exists (same signatures as runtime/attention.py's reference path, see
docs/interfaces.md):

    write_kv(cache, k, v, slot_mapping)
        fused quantize-on-write of a step's K/V [T, kv_heads, head_dim] into the
        paged cache; every format and granularity; bytes equal kv_format.quantize.
    decode_attention(q, cache, block_tables, seq_lens, sm_scale) -> out
        paged, GQA-grouped decode attention with in-register dequantization,
        fp32 online softmax and split-K for long contexts.
    prefill_context_attention(q, k, v, cu_seqlens, cache, block_tables, context_lens, sm_scale) -> out
        chunked prefill: each chunk's queries (x the GQA group) over its cached context,
        read from the pages and dequantized in registers, then causally over its own
        full-precision K/V, in one fp32 online softmax; no host sync.

`write_kv_launch` / `decode_attention_launch` / `prefill_context_attention_launch`
take the same arguments plus tuning knobs (tile sizes, warps, split count) for
benchmarks and tests; the first two default to the fastest tiles measured on the
H200 (benchmarks/KERNEL_NOTES.md), the prefill kernel to untimed ones (prefill_context.py).
Files: formats.py (KV format -> compile-time constants, cache checks),
write_kv.py, decode_attention.py (launcher and the query-heads x tokens kernel),
decode_warps.py (the one-softmax-state-per-warp kernel), decode_gluon.py (the
decode kernel the quantized formats run on the GPU, written in Gluon with explicit
register layouts; the Triton kernels serve the interpreter, bf16 and the shapes it
does not support), dequant.py (widening helpers both Triton kernels share), widen_ptx.py
(the inline PTX that widens stored values, for the Triton and the Gluon kernels), group_io.py
(their q load, scale folding and output/partial store), tuning.py
(per-format launch defaults, the Gluon kernel's register caps), split_k.py (split count, merge kernel), prefill_context.py
(the chunked-prefill kernel; it reuses the decode kernels' dequantization helpers).
Kernels run on CUDA tensors; on CPU only under TRITON_INTERPRET=1 (set before
this package is imported), otherwise they raise UnsupportedError.
No kernel for prefill_attention: a whole prompt's prefill is full-precision attention,
and runtime/attention.py falls back to its reference (torch SDPA, flash on CUDA) for it.
"""

from .decode_attention import decode_attention, decode_attention_launch
from .prefill_context import prefill_context_attention, prefill_context_attention_launch
from .split_k import choose_num_splits
from .write_kv import write_kv, write_kv_launch

__all__ = ["write_kv", "write_kv_launch", "decode_attention", "decode_attention_launch", "prefill_context_attention",
           "prefill_context_attention_launch", "choose_num_splits"]
