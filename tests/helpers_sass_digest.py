"""Cross-compile the kernels' default builds for sm_90 and print a digest of each one's PTX and SASS, so that a
restructuring of the kernels' source can be shown to change no instruction. The builds are the distinct launches
(kernel, constexprs, argument types, launch options) recorded by tests/helpers_launch_record.py on the H200 for
benchmarks/kernels.py's grid (its formats x Llama-3-8B / 70B TP8 / TP2 x its (batch, context) shapes, bf16 q),
the write kernel and the prefill-context kernel at one shape each. Run without TRITON_INTERPRET:

    python -m tests.helpers_sass_digest tests/data/kernel_launches_6941f60.json.gz OUT.json \
        [tests/data/sass_digests_6941f60.json]

With a third argument it compares OUT with those digests (6941f60's, Triton 3.6.0) and exits 1 where any differ.

Line information is left out of the builds (TRITON_DISABLE_LINE_INFO): the source's line numbers are not code.
A constexpr a launch record has and the kernel no longer takes is dropped (a deleted variant's switch; the
plan test, tests/test_kernel_plans.py, checks it was off)."""

from __future__ import annotations

import gzip
import hashlib
import importlib
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_FORMATS = ("bf16", "fp8_e4m3-per_tensor", "fp8_e4m3-per_token", "int8-per_tensor", "int8-per_token",
                 "int8-per_token-asym", "int4-per_head", "int4-per_token", "int4-per_token-asym")
BENCH_GEOMETRIES = ("llama3-8b", "llama3-70b-tp8", "llama3-70b-tp2")
BENCH_SHAPES = ((1, 131072), (16, 32768), (32, 32768), (64, 32768), (64, 8192), (128, 4096))
DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "int8": "i8", "uint8": "u8", "int32": "i32",
          "int64": "i64", "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5"}


def selected(row: dict) -> bool:
    op, args = row["op"], row["args"]
    if args[0] not in BENCH_FORMATS:
        return False
    if op == "decode":
        return (args[1] in BENCH_GEOMETRIES and tuple(args[2:4]) in BENCH_SHAPES and args[4] == "bfloat16"
                and args[5] == "h200" and args[6] == 16)
    if op == "write":
        return args[1:] == [8, 128, 1024, "bfloat16", "h200"]
    return args[1:] == ["llama3-8b", 1, 512, 32768, "bfloat16", "h200"]


def build_key(launch: dict) -> str:
    """A launch without its shapes and scalar values (what the compiler does not specialise on)."""
    def typed(k, v):
        if isinstance(v, str) and v.startswith(("tensor", "descriptor")):
            return v.split(" [")[0] + (" " + v.split("] ", 2)[-1] if v.startswith("descriptor") else "")
        if isinstance(v, int) and not isinstance(v, bool) and not k[0].isupper() and k not in (
                "num_warps", "num_stages", "maxnreg"):
            return "int%16" if v % 16 == 0 else "int"
        return v
    return json.dumps({k: typed(k, v) for k, v in launch.items() if k != "grid"}, sort_keys=True)


def kernel_named(name: str):
    import runtime.kernels as package

    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"runtime.kernels.{info.name}")
        if hasattr(module, name):
            return getattr(module, name)
    raise LookupError(f"no kernel {name} in runtime.kernels")


def _descriptor_type(value: str) -> str:
    import torch
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    from triton.runtime.jit import mangle_type

    _, dtype, rest = value.split(" ", 2)
    block = json.loads(rest[:rest.index("]") + 1])
    layout = eval(rest.split("] ", 2)[-1], {"NVMMASharedLayout": gl.NVMMASharedLayout})  # our own record's repr
    return mangle_type(TensorDescriptor.from_tensor(torch.zeros(64, 16, dtype=getattr(torch, dtype)), block, layout))


def compile_build(launch: dict) -> dict:
    """PTX and SASS digests of the launch's build for sm_90."""
    import triton

    compiled = compile_launch(launch)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    sass = "\n".join(line for line in sass.splitlines() if not re.match(r"\s*(Fatbin|code for|\.)", line))
    return dict(ptx=hashlib.sha256(compiled.asm["ptx"].encode()).hexdigest()[:16],
                sass=hashlib.sha256(sass.encode()).hexdigest()[:16])


def compile_launch(launch: dict):
    """The launch's build compiled for sm_90 (triton.compile's kernel: .asm["cubin"], .metadata)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    fn = kernel_named(launch["kernel"])
    sig, consts, attrs = {}, {}, {}
    for i, param in enumerate(fn.params):
        name = param.name
        value = launch[name] if name in launch else param.default
        if param.is_constexpr:
            sig[name], consts[(i,)] = "constexpr", value
        elif isinstance(value, str) and value.startswith("tensor"):
            sig[name], attrs[(i,)] = "*" + DTYPES[value.split()[1]], [["tt.divisibility", 16]]
        elif isinstance(value, str) and value.startswith("descriptor"):
            sig[name] = _descriptor_type(value)
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    source = (GluonASTSource if isinstance(fn, GluonJITFunction) else triton.compiler.ASTSource)(
        fn, sig, constexprs=consts, attrs=attrs)
    options = {k: launch[k] for k in ("num_warps", "num_stages", "maxnreg") if k in launch}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def main(records: str, out: str) -> None:
    os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # read when a kernel compiles
    rows = json.load(gzip.open(records))
    builds = {}
    for row in rows:
        if selected(row):
            for launch in row["launches"]:
                builds.setdefault(build_key(launch), launch)
    digests = {}
    for i, (key, launch) in enumerate(sorted(builds.items())):
        try:
            digests[key] = compile_build(launch)
        except Exception as e:  # that build's failure, reported; the others go on
            digests[key] = dict(error=f"{type(e).__name__}: {str(e)[-500:]}")
        print(i, launch["kernel"], digests[key], flush=True)
    Path(out).write_text(json.dumps(digests, indent=0, sort_keys=True))
    print(f"{len(digests)} builds -> {out}")


def compare(out: str, reference: str) -> int:
    got, want = json.loads(Path(out).read_text()), json.loads(Path(reference).read_text())
    differ = sorted(k for k in want if got.get(k) != want[k])
    print(f"{len(want) - len(differ)} of {len(want)} builds identical (PTX and SASS)")
    for key in differ:
        print("differs:", json.loads(key)["kernel"], want[key], got.get(key))
    return 1 if differ else 0


if __name__ == "__main__":
    main(*sys.argv[1:3])
    if len(sys.argv) > 3:
        sys.exit(compare(sys.argv[2], sys.argv[3]))
