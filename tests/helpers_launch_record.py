"""Record the kernel launches kvq's public ops make, without a GPU: every tensor is a fake (shape and dtype
only, torch's FakeTensorMode) and every Triton / Gluon launch is captured instead of run, with its grid, its
scalar arguments, its constexprs and launch options. With an H200's device properties patched in, that is
exactly what the ops launch on the H200, so two versions of kvq can be compared launch for launch
(tests/test_kernel_plans.py) on a CPU box. `python -m tests.helpers_launch_record OUT.json.gz` writes the table."""

from __future__ import annotations

import contextlib
import gzip
import itertools
import json
import sys
import types
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

H200 = dict(sms=132, capability=(9, 0))
# (query heads, KV heads, head_dim): Llama-3-8B, Llama-3-70B at TP 8 and TP 2, SmolLM2-135M
GEOMETRIES = {"llama3-8b": (32, 8, 128), "llama3-70b-tp8": (8, 1, 128), "llama3-70b-tp2": (32, 4, 128),
              "smollm2-135m": (9, 3, 64)}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
CONTEXTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)


def formats():
    from runtime.kv_format import KVFormat

    out = [KVFormat(d) for d in ("fp32", "fp16", "bf16")]
    for dtype in ("fp8_e4m3", "fp8_e5m2", "int8", "int4"):
        out += [KVFormat(dtype, g) for g in ("per_tensor", "per_head", "per_token")]
        if dtype in ("int8", "int4"):
            out.append(KVFormat(dtype, "per_token", symmetric=False))
    return out


def _value(v):
    if isinstance(v, torch.Tensor):
        return f"tensor {str(v.dtype).removeprefix('torch.')} {list(v.shape)}"
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if hasattr(v, "block_shape"):  # a TMA tensor descriptor
        return f"descriptor {str(v.base.dtype).removeprefix('torch.')} {list(v.block_shape)} {list(v.shape)} {v.layout!r}"
    if isinstance(v, (tuple, list)):
        return [_value(x) for x in v]
    return repr(v)


@contextlib.contextmanager
def recording(device: str):
    """Capture launches (a list of dicts) made inside; device 'h200' patches an H200's properties in, 'cpu'
    sets the Triton interpreter's runtime flag (the kernels are not run either way)."""
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    launches: list[dict] = []

    def run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        row = {"kernel": self.fn.__name__, "grid": list(grid) if not callable(grid) else repr(grid)}
        row.update({names[i]: _value(a) for i, a in enumerate(args)})
        row.update({k: _value(v) for k, v in kwargs.items()})
        launches.append(row)

    saved = (JITFunction.run, InterpretedFunction.run, torch.cuda.get_device_properties,
             torch.cuda.get_device_capability, knobs.runtime.interpret)
    JITFunction.run = InterpretedFunction.run = run  # kernels are the second under TRITON_INTERPRET=1
    if device == "h200":
        torch.cuda.get_device_properties = lambda d=None: types.SimpleNamespace(
            multi_processor_count=H200["sms"], name="NVIDIA H200")
        torch.cuda.get_device_capability = lambda d=None: H200["capability"]
        knobs.runtime.interpret = False
    else:
        knobs.runtime.interpret = True
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TMA descriptors read a fake tensor's (meaningless) data pointer
            yield launches
    finally:
        (JITFunction.run, InterpretedFunction.run, torch.cuda.get_device_properties,
         torch.cuda.get_device_capability, knobs.runtime.interpret) = saved


def _cache(fmt, num_blocks, block_size, kv_heads, head_dim, device):
    from runtime.kv_cache import allocate_layer

    scales = {}
    if fmt.static:
        shape = () if fmt.granularity == "per_tensor" else (kv_heads,)
        scales = {name: torch.ones(shape, dtype=torch.float32, device=device) for name in ("k_scale", "v_scale")}
    return allocate_layer(fmt, num_blocks, block_size, kv_heads, head_dim, device, **scales)


def decode_launches(fmt, geometry, batch, ctx, q_dtype, device, block_size=16):
    import runtime.kernels as kernels

    heads, kv_heads, head_dim = GEOMETRIES[geometry]
    dev = torch.device("cuda", 0) if device == "h200" else torch.device("cpu")
    with recording(device) as launches:
        pages = -(-ctx // block_size)
        cache = _cache(fmt, batch * pages, block_size, kv_heads, head_dim, dev)
        q = torch.empty(batch, heads, head_dim, dtype=q_dtype, device=dev)
        bt = torch.empty(batch, pages, dtype=torch.int32, device=dev)
        seq = torch.empty(batch, dtype=torch.int32, device=dev)
        kernels.decode_attention(q, cache, bt, seq, 0.088)
    return launches


def write_launches(fmt, kv_heads, head_dim, tokens, k_dtype, device):
    import runtime.kernels as kernels

    dev = torch.device("cuda", 0) if device == "h200" else torch.device("cpu")
    with recording(device) as launches:
        cache = _cache(fmt, 64, 16, kv_heads, head_dim, dev)
        k = torch.empty(tokens, kv_heads, head_dim, dtype=k_dtype, device=dev)
        kernels.write_kv(cache, k, torch.empty_like(k), torch.empty(tokens, dtype=torch.int64, device=dev))
    return launches


def prefill_launches(fmt, geometry, chunks, chunk, ctx, q_dtype, device):
    import runtime.kernels as kernels

    heads, kv_heads, head_dim = GEOMETRIES[geometry]
    dev = torch.device("cuda", 0) if device == "h200" else torch.device("cpu")
    with recording(device) as launches:
        pages = -(-ctx // 16)
        cache = _cache(fmt, chunks * pages, 16, kv_heads, head_dim, dev)
        q = torch.empty(chunks * chunk, heads, head_dim, dtype=q_dtype, device=dev)
        k = torch.empty(chunks * chunk, kv_heads, head_dim, dtype=q_dtype, device=dev)
        kernels.prefill_context_attention(
            q, k, torch.empty_like(k), torch.empty(chunks + 1, dtype=torch.int32, device=dev), cache,
            torch.empty(chunks, pages, dtype=torch.int32, device=dev),
            torch.empty(chunks, dtype=torch.int32, device=dev), 0.088)
    return launches


def cases():
    """(op, arguments) of the recorded grid: every format x geometry x batch x context for decode (bf16 / fp16 q
    on the H200, bf16 / fp32 q in the interpreter; pages of 16, and of 64 at a few shapes), the write at a
    range of token counts, the prefill kernel at a few chunk shapes."""
    for fmt, device in itertools.product(formats(), ("h200", "cpu")):
        q_dtypes = ("bfloat16", "float16") if device == "h200" else ("bfloat16", "float32")
        for geometry, batch, ctx, q_dtype in itertools.product(GEOMETRIES, BATCHES, CONTEXTS, q_dtypes):
            yield "decode", (fmt.name, geometry, batch, ctx, q_dtype, device, 16)
        for geometry, batch, ctx in itertools.product(("llama3-8b", "llama3-70b-tp8"), (1, 16, 64),
                                                      (4096, 32768, 131072)):
            yield "decode", (fmt.name, geometry, batch, ctx, "bfloat16", device, 64)
        for kv_heads, head_dim, tokens, k_dtype in itertools.product(
                (1, 3, 8), (64, 128), (1, 8, 64, 128, 1024, 524288), ("bfloat16", "float16", "float32")):
            yield "write", (fmt.name, kv_heads, head_dim, tokens, k_dtype, device)
        for geometry, (chunks, chunk, ctx), q_dtype in itertools.product(
                ("llama3-8b", "llama3-70b-tp8", "smollm2-135m"), ((1, 512, 32768), (4, 128, 4096), (2, 2048, 8192)),
                ("bfloat16", "float16", "float32")):
            yield "prefill", (fmt.name, geometry, chunks, chunk, ctx, q_dtype, device)


def launches_of(op: str, args: tuple) -> list[dict]:
    fmt = {f.name: f for f in formats()}[args[0]]
    if op == "decode":
        name, geometry, batch, ctx, q_dtype, device, bs = args
        return decode_launches(fmt, geometry, batch, ctx, getattr(torch, q_dtype), device, bs)
    if op == "write":
        name, kv_heads, head_dim, tokens, k_dtype, device = args
        return write_launches(fmt, kv_heads, head_dim, tokens, getattr(torch, k_dtype), device)
    name, geometry, chunks, chunk, ctx, q_dtype, device = args
    return prefill_launches(fmt, geometry, chunks, chunk, ctx, getattr(torch, q_dtype), device)


def record(path: str) -> None:
    rows = []
    for i, (op, args) in enumerate(cases()):
        if i % 2000 == 0:
            print(i, flush=True)
        try:
            rows.append({"op": op, "args": list(args), "launches": launches_of(op, args)})
        except Exception as e:  # an op that refuses the case: its error is part of the behaviour
            rows.append({"op": op, "args": list(args), "error": type(e).__name__})
    with gzip.open(path, "wt") as f:
        json.dump(rows, f, separators=(",", ":"))
    print(f"{len(rows)} cases -> {path}")


if __name__ == "__main__":
    record(sys.argv[1])
