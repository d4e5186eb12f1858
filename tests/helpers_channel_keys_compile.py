"""Cross-compile, for sm_90, the builds the per-channel-key format's ops launch on the H200 (decode with bf16 q at
Llama-3-8B 16 x 32768, 64 x 8192 and 1 x 131072: the Gluon kernel; at SmolLM2-135M 64 x 4096 and 1 x 8192: the
Triton kernel's one- and two-warp plans; the split merge; the write of 1024 tokens), and print one JSON line each. The launches are recorded without a GPU (tests/helpers_launch_record.py);
the interpreter runs what the compiler refuses (a non-constexpr global read inside a @jit function), so this is the
CPU check that the GPU builds exist. Run without TRITON_INTERPRET (`python -m tests.helpers_channel_keys_compile`;
tests/test_kernel_channel_keys.py runs it in a subprocess)."""

from __future__ import annotations

import json

import torch

from runtime.kv_cache import allocate_layer
from runtime.kv_format import PER_CHANNEL_TOKENS, format_from_name
from tests.helpers_launch_record import recording

FMT = format_from_name("k.int4-per_channel-asym+v.int4-per_token-asym")


def launches() -> list[dict]:
    import runtime.kernels as kernels

    dev = torch.device("cuda", 0)
    out = []
    with recording("h200") as rows:
        # Llama-3-8B (the Gluon kernel) and SmolLM2-135M (head_dim 64: the Triton kernel, one and two warps)
        for (heads, kv_heads, head_dim), batch, ctx in (((32, 8, 128), 16, 32768), ((32, 8, 128), 64, 8192),
                                                        ((32, 8, 128), 1, 131072), ((9, 3, 64), 64, 4096),
                                                        ((9, 3, 64), 1, 8192)):
            pages = ctx // PER_CHANNEL_TOKENS
            cache = allocate_layer(FMT, batch * pages, PER_CHANNEL_TOKENS, kv_heads, head_dim, dev,
                                   residual_slots=batch)
            q = torch.empty(batch, heads, head_dim, dtype=torch.bfloat16, device=dev)
            bt = torch.empty(batch, pages, dtype=torch.int32, device=dev)
            kernels.decode_attention(q, cache, bt, torch.empty(batch, dtype=torch.int32, device=dev), 0.088)
        k = torch.empty(1024, kv_heads, head_dim, dtype=torch.bfloat16, device=dev)
        kernels.write_kv(cache, k, torch.empty_like(k), torch.empty(1024, dtype=torch.int64, device=dev))
        out += rows
    return out


def main() -> None:
    from tests.helpers_sass_digest import compile_launch

    seen = set()
    for launch in launches():
        key = json.dumps({k: v for k, v in launch.items() if k != "grid"}, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        try:
            compile_launch(launch)
            row = dict(ok=True)
        except Exception as e:  # that build's failure, reported; the others go on
            row = dict(ok=False, error=f"{type(e).__name__}: {str(e)[-1500:]}")
        print(json.dumps(dict(kernel=launch["kernel"], num_warps=launch.get("num_warps"), **row)), flush=True)


if __name__ == "__main__":
    main()
