"""Triton-language (and Gluon) GPU kernels for the paged, quantized KV cache, planned once and run many times.

The public ops have runtime/attention.py's signatures plus `plan=` (docs/interfaces.md):

    write_kv(cache, k, v, slot_mapping, plan=None)
        fused quantize-on-write of a step's K/V [T, kv_heads, head_dim] into the paged cache; every
        format and granularity; bytes equal kv_quant.quantize.
    decode_attention(q, cache, block_tables, seq_lens, sm_scale, plan=None) -> out
        paged, GQA-grouped decode attention with in-register dequantization, fp32 online softmax and
        split-K for long contexts.
    prefill_context_attention(q, k, v, cu_seqlens, cache, block_tables, context_lens, sm_scale, plan=None) -> out
        chunked prefill: each chunk's queries over its cached context, read from the pages, then causally
        over its own full-precision K/V, in one fp32 online softmax; no host sync.

A plan (`DecodePlan`, `WritePlan`, `PrefillPlan`) is what a launch decides before it runs; `decode_plan`,
`write_plan` and `prefill_plan` make the default one from (format, shape, device), and benchmarks vary it
with `dataclasses.replace`. Roles, one file each:

    plan.py          the plan objects and the functions that make them
    tuned_file.py    the tuned data's schema, its field-by-field checks and loader; `Device`, which keys it
    tuned/*.json     per-format choices by GPU (the H200's serves the others), written by benchmarks/tune.py
    tuning.py        the rules that depend on the shape or the GPU (split counts, the int4 ring, register caps)
    launch.py        the public ops: validation, default plans, launches
    launch_mixed.py  the same ops for the mixed formats (K and V of their own formats, group / e8m0 scales:
                     `formats.served_by_mixed`), with write_mixed.py and decode_mixed.py (decode on the GPU:
                     decode_gluon.py for the K/V-split, group-64 and int4 group-32 formats, launch.py)
    kernels          decode_gluon.py (+ gluon_attend / gluon_groups / gluon_operands / gluon_tiles.py), decode_warps.py,
                     decode_tiles.py, write_kv.py (+ write_rows.py, exact_round.py), prefill_context.py,
                     split_k.py (split counts, the merge kernel)
    batch-invariant  invariant_gemm.py (one tile config per weight, whatever M), invariant_attention.py (every
                     decode and prompt row through one decode plan; the mode's CUDA backend), docs/numerics.md
    shared pieces    codes.py (the format's compile-time codes), formats.py (format -> codes, cache checks),
                     dequant.py, group_io.py, widen_ptx.py (the Triton kernels' widening and tile I/O)

Kernels run on CUDA tensors; on CPU only under TRITON_INTERPRET=1 (set before this package is imported),
otherwise they raise UnsupportedError. No kernel for prefill_attention: a whole prompt's prefill is
full-precision attention, and runtime/attention.py falls back to its reference (torch SDPA) for it.
"""

from .launch import decode_attention, decode_plan_for, prefill_context_attention, write_kv
from .plan import DecodePlan, PrefillPlan, WritePlan, decode_plan, prefill_plan, write_plan
from .split_k import choose_num_splits
from .tuned_file import Device

__all__ = ["write_kv", "decode_attention", "prefill_context_attention", "DecodePlan", "WritePlan", "PrefillPlan",
           "Device", "decode_plan", "write_plan", "prefill_plan", "decode_plan_for", "choose_num_splits"]
