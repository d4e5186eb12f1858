"""kvq's paged decode attention against FlashInfer and TensorRT-LLM's XQA, on the same KV bytes.

On the GPU machine, from the repository root, with flashinfer-python 0.6.5 importable
(benchmarks/README.md says how to carry it; FlashInfer JIT-compiles its kernels on first use):

    CUDA_HOME=/usr/local/cuda python3 -m benchmarks.peers --out benchmarks/results
    python3 -m benchmarks.peers --smoke --out /tmp/peers      # CPU: tiny shape, kvq under the Triton interpreter

For each shape (Llama-3 attention geometry x batch x context) and KV format (BF16; FP8 e4m3 with
one per-tensor scale) one paged cache is written, and every implementation reads that same cache
in place: kvq's public decode op (default plan), FlashInfer's BatchDecodeWithPagedKVCacheWrapper,
XQA (flashinfer.xqa). Each output is checked against an fp64 attention over the stored values
before it is timed and again after; times are GPU times from CUDA-graph replays with L2 emptied
before each call (benchmarks/gpu_timing.median_ms, the kernel benchmark's timer). torch SDPA with
the cuDNN backend on dense BF16 K/V of the same shape is the common baseline column, as in
kernels.md. Rows go to OUT/peers.jsonl (the environment row first), the table to OUT/peers.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.config import preset
from runtime.kv_format import KVFormat

from . import peer_kernels
from .gpu_timing import env_line
from .kernels import FORMATS as KERNEL_FORMATS
from .peer_kernels import IMPLEMENTATIONS, LABELS

PEER_FORMATS = ("bf16", "fp8_e4m3")  # what FlashInfer and XQA read in kvq's layout
# and kvq's own formats (docs/kv-formats.md): no peer reads them, so only kvq runs there (its row beside the peers'
# BF16 / FP8 rows of the same shape and the cuDNN baseline); benchmarks/kernels.py's formats of those names
OWN_FORMATS = ("k8v4", "k8v4-g32", "int4-tok-asym", "int4-g64-asym", "int4-g32-asym")
FORMATS = {name: KERNEL_FORMATS[name] for name in (*PEER_FORMATS, *OWN_FORMATS)}
# Tolerance: twice the unit roundoff u of the narrowest type a kernel may round to on the way: bf16
# for BF16 KV; for FP8 KV its own e4m3, since XQA rounds q and P to e4m3 for its FP8 MMAs. A kernel
# may round P, its split-K partials (XQA keeps them in bf16) and the output, each with an rms relative
# error of u / sqrt(3): about u together, so 2u bounds a correct kernel's norm-wise error over a finite
# sample, while a wrong page, scale or mask costs an error of order 1.
PRODUCT_DTYPE = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn,
                 **{name: torch.bfloat16 for name in OWN_FORMATS}}
TOLERANCE = {name: torch.finfo(dt).eps for name, dt in PRODUCT_DTYPE.items()}  # eps = 2u
PAGE_SIZE = 16  # kvq's engine default, and XQA's smallest (XQA takes 16, 32, 64 or 128)
SHAPES = ["llama3-8b:16x32768", "llama3-8b:64x8192", "llama3-8b:128x4096", "llama3-8b:1x131072",
          "llama3-70b/tp8:16x32768", "llama3-70b/tp8:1x131072"]
SMOKE_SHAPES = ["tiny-llama3:2x64", "tiny-llama3/tp2:1x80"]


@dataclass(frozen=True)
class Shape:
    """A model's attention geometry on one GPU (query heads and KV heads divided by TP) x batch x context."""

    model: str
    tp: int
    batch: int
    ctx: int

    @classmethod
    def parse(cls, text: str) -> Shape:
        """'llama3-8b:16x32768' or 'llama3-70b/tp8:16x32768'."""
        try:
            model, bc = text.split(":")
            model, _, tp = model.partition("/tp")
            batch, ctx = bc.split("x")
            shape = cls(model, int(tp or 1), int(batch), int(ctx))
        except ValueError:
            raise SystemExit(
                f"--shapes {text!r}: write MODEL[/tpN]:BATCHxCONTEXT, e.g. llama3-70b/tp8:16x32768") from None
        cfg = preset(shape.model)
        if cfg.num_kv_heads % shape.tp:
            raise SystemExit(f"--shapes {text}: {cfg.num_kv_heads} KV heads do not split over TP {shape.tp}")
        return shape

    @property
    def geometry(self) -> tuple[int, int, int]:
        cfg = preset(self.model)
        return cfg.num_heads // self.tp, cfg.num_kv_heads // self.tp, cfg.head_dim

    @property
    def label(self) -> str:
        return self.model + (f" TP{self.tp}" if self.tp > 1 else "")


class PagedCase:
    """Inputs of one shape: bf16 q and source K/V, pages in random order, every sequence full length."""

    def __init__(self, shape: Shape, page: int, device: str, seed: int = 0):
        self.shape, self.page = shape, page
        self.heads, self.kv_heads, self.head_dim = shape.geometry
        b, ctx = shape.batch, shape.ctx
        g = torch.Generator(device=device).manual_seed(seed)
        randn = lambda *s: torch.randn(*s, device=device, generator=g, dtype=torch.bfloat16)  # noqa: E731
        self.k_src, self.v_src = randn(b * ctx, self.kv_heads, self.head_dim), randn(b * ctx, self.kv_heads, self.head_dim)
        self.k_src[:, :, 3] += 3.0  # an outlier channel, as real keys have
        self.q = randn(b, self.heads, self.head_dim)
        pages = -(-ctx // page)
        self.block_tables = torch.randperm(b * pages, device=device, generator=g).view(b, pages).to(torch.int32)
        t = torch.arange(ctx, device=device)
        self.slots = (self.block_tables[:, t // page].long() * page + t % page).flatten()
        self.seq_lens = torch.full((b,), ctx, dtype=torch.int32, device=device)
        self.sm_scale = 1.0 / math.sqrt(self.head_dim)

    def cache(self, fmt: KVFormat):
        """The paged cache written by kvq's reference write (runtime.attention.write_kv), and the FP8
        scale: one per-tensor scale for K and V, max of both amax / 448 (TensorRT-LLM's convention)."""
        from runtime.attention import write_kv
        from runtime.kv_cache import allocate_layer

        scale = None
        ks = vs = None
        if fmt.static:
            amax = max(self.k_src.abs().max().item(), self.v_src.abs().max().item())
            scale = amax / fmt.qmax
            ks = vs = torch.tensor(scale, dtype=torch.float32, device=self.q.device)
            scale = ks.item()  # the fp32 value the kernels see
        cache = allocate_layer(fmt, self.block_tables.numel(), self.page, self.kv_heads, self.head_dim,
                               self.q.device, ks, vs)
        write_kv(cache, self.k_src, self.v_src, self.slots)
        return cache, scale

    def kv_bytes(self, fmt: KVFormat) -> int:
        return int(2 * self.shape.batch * self.shape.ctx * self.kv_heads * fmt.bytes_per_token_head(self.head_dim))


def _stored(cache, which: str, pages: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence's K or V exactly as stored, in fp64: [kv_heads, length, head_dim]."""
    fmt = cache.fmt.side(which)
    if fmt.dynamic:  # per-token / group scales: kv_format's dequantization of the stored bytes
        from runtime.kv_quant import dequantize

        z = getattr(cache, f"{which}_zero")
        x = dequantize(getattr(cache, which)[pages], fmt, getattr(cache, f"{which}_scale")[pages],
                       None if z is None else z[pages]).double()
    else:
        x = getattr(cache, which)[pages].double()  # [pages, kv_heads, page, D]
        s = getattr(cache, f"{which}_scale")
        x = x * s.double() if s is not None else x
    return x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[3])[:, :length]


def reference_fp64(case: PagedCase, cache) -> torch.Tensor:
    """fp64 attention over the values as stored (pages dequantized exactly), one sequence at a time."""
    out = torch.empty(case.q.shape, dtype=torch.float64, device=case.q.device)
    g = case.heads // case.kv_heads
    for i, length in enumerate(case.seq_lens.tolist()):
        pages = case.block_tables[i, : -(-length // case.page)].long()
        k, v = _stored(cache, "k", pages, length), _stored(cache, "v", pages, length)
        q = case.q[i].double().view(case.kv_heads, g, case.head_dim)
        p = torch.softmax(q @ k.transpose(1, 2) * case.sm_scale, -1)
        out[i] = (p @ v).reshape(case.heads, case.head_dim)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; inf where any element is not finite (an unwritten NaN-poisoned output)."""
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf
    return ((out - ref).norm() / ref.norm()).item()


def cpu_median_ms(fn, reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(impl: str, case: PagedCase, cache, scale, ref: torch.Tensor, timer) -> dict:
    """Check, time, check again (a race or a stale split-K semaphore shows as a second error)."""
    call, detail = IMPLEMENTATIONS[impl](case, cache, scale)
    err = relative_error(call(), ref)
    ms = timer(call)
    err_after = relative_error(call(), ref)
    return {"ms": ms, "relerr": max(err, err_after), "relerr_first": err, "detail": detail}


def run(shapes: list[Shape], fmt_names: list[str], impls: list[str], page: int, out: Path, device: str) -> list[dict]:
    if device == "cuda":
        from .gpu_timing import DEFAULT_FLUSH, ceilings, gpu_env, median_ms

        env = gpu_env(flush=DEFAULT_FLUSH, **ceilings(DEFAULT_FLUSH))
        timer, timing = median_ms, f"cuda graph, L2 flushed per call ({DEFAULT_FLUSH})"
    else:
        import platform

        env = {"kind": "env", "gpu": "none (CPU, Triton interpreter)", "sms": 0, "torch": torch.__version__,
               "triton": "interpreter", "cuda": None, "python": platform.python_version(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        timer, timing = cpu_median_ms, "host clock, median of 3 (CPU smoke run: not a speed)"
    env.update(page_size=page, impls=impls, versions=peer_versions(impls))
    failed_builds: dict[str, str] = {}
    peers = [i for i in impls if i != "kvq"]
    if peers:
        t0 = time.time()
        failed_builds = peer_kernels.compile_peers(
            peers, torch.bfloat16, [FORMATS[f].storage_dtype for f in fmt_names if f in PEER_FORMATS], page,
            sorted({(s.geometry[2], s.geometry[0] // s.geometry[1]) for s in shapes}))
        env["peer_build_s"] = round(time.time() - t0, 1)
        print(f"peer kernels built in {env['peer_build_s']} s; failed: {failed_builds or 'none'}", flush=True)
    rows: list[dict] = [env]
    tmp = out / "peers.jsonl.tmp"
    with open(tmp, "w") as sink:
        sink.write(json.dumps(env) + "\n")
        for shape in shapes:
            case = PagedCase(shape, page, device)
            sdpa_call, sdpa_backend = peer_kernels.dense_sdpa(case)
            sdpa_ms = timer(sdpa_call)
            print(f"{shape.label} {shape.batch}x{shape.ctx}: SDPA[{sdpa_backend}] {sdpa_ms:.3f} ms", flush=True)
            for name in fmt_names:
                fmt = FORMATS[name]
                cache, scale = case.cache(fmt)
                ref = reference_fp64(case, cache)
                for impl in [i for i in impls if i == "kvq" or name in PEER_FORMATS]:
                    row = {"kind": "decode", "model": shape.model, "tp": shape.tp, "batch": shape.batch,
                           "ctx": shape.ctx, "format": name, "fmt": fmt.name, "impl": impl,
                           "heads": case.heads, "kv_heads": case.kv_heads, "head_dim": case.head_dim,
                           "page_size": page, "kv_bytes": case.kv_bytes(fmt), "tolerance": TOLERANCE[name],
                           "sdpa_ms": sdpa_ms, "sdpa_backend": sdpa_backend, "timing": timing}
                    try:
                        if impl in failed_builds:
                            raise RuntimeError(f"kernel build failed: {failed_builds[impl]}")
                        row.update(measure(impl, case, cache, scale, ref, timer))
                        row.update(gbps=row["kv_bytes"] / row["ms"] / 1e6, vs_cudnn_bf16=sdpa_ms / row["ms"],
                                   ok=row["relerr"] <= TOLERANCE[name])
                    except Exception as e:  # one implementation failing must not hide the others' rows
                        row.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
                    rows.append(row)
                    sink.write(json.dumps(row) + "\n")
                    sink.flush()
                    print("  " + row_line(row), flush=True)
                del cache, ref
            del case
            if device == "cuda":
                torch.cuda.empty_cache()
    os.replace(tmp, out / "peers.jsonl")
    write_text(out / "peers.md", markdown(rows))
    return rows


def peer_versions(impls: list[str]) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for dist in ("flashinfer-python", "apache-tvm-ffi") if set(impls) - {"kvq"} else ():
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def row_line(r: dict) -> str:
    head = f"{r['format']:9s} {LABELS[r['impl']]:17s}"
    if "error" in r:
        return f"{head} FAILED {r['error'][:160]}"
    return (f"{head} {r['ms']:.3f} ms {r['gbps']:5.0f} GB/s x{r['vs_cudnn_bf16']:.2f} vs cuDNN "
            f"err {r['relerr']:.1e} ({'ok' if r['ok'] else 'OVER ' + format(r['tolerance'], '.1e')}) [{r['detail']}]")


def write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def markdown(rows: list[dict]) -> str:
    env, data = rows[0], [r for r in rows if r["kind"] == "decode"]
    impls = env["impls"]
    peers = [i for i in impls if i != "kvq" and "kvq" in impls]
    versions = "".join(f" {k} {v}." for k, v in env.get("versions", {}).items())
    ceil = (f" Read ceiling measured in the same run: {env['read_gbps']:.0f} GB/s (a 2 GiB reduction)."
            if "read_gbps" in env else "")
    lines = [
        "# Paged decode attention: kvq, FlashInfer, TensorRT-LLM XQA",
        "",
        env_line(env) + versions + ceil,
        f"One paged cache per shape and format, read in place by every implementation: pages of "
        f"{env['page_size']} tokens in kvq's layout [pages, kv_heads, page, head_dim] (HND), in random order, "
        "every sequence full length, q and out bf16. FP8 = e4m3 with one per-tensor scale shared by K and V "
        "(XQA takes one). Times: GPU time per call from CUDA-graph replays with L2 emptied before each call; "
        "GB/s = KV bytes read / time. cuDNN BF16 = torch SDPA's cuDNN backend on dense BF16 K/V of the "
        "same shape (the common baseline). kvq runs its public decode op with its default plan.",
        "",
        "| " + " | ".join(["model", "batch x ctx", "KV", *(f"{LABELS[i]} ms (GB/s)" for i in impls), "cuDNN BF16 ms",
                           *(f"kvq vs {LABELS[i]}" for i in peers)]) + " |",
        "|---" * (4 + len(impls) + len(peers)) + "|",
    ]
    by_key = {(r["model"], r["tp"], r["batch"], r["ctx"], r["format"], r["impl"]): r for r in data}
    keys = list(dict.fromkeys((r["model"], r["tp"], r["batch"], r["ctx"], r["format"]) for r in data))

    def cell(r: dict | None) -> str:
        if r is None:
            return "-"
        if "error" in r:
            return "failed"
        return f"{r['ms']:.3f} ({r['gbps']:.0f})" + ("" if r["ok"] else " **wrong**")

    for key in keys:
        got = {i: by_key.get((*key, i)) for i in impls}
        any_row = next(r for r in got.values() if r is not None)
        model = key[0] + (f" TP{key[1]}" if key[1] > 1 else "")
        kvq = got.get("kvq")
        ratios = []
        for i in peers:
            r = got[i]
            good = kvq and r and "error" not in kvq and "error" not in r
            ratios.append(f"{r['ms'] / kvq['ms']:.2f}x" if good else "-")
        cells = [model, f"{key[2]}x{key[3]}", key[4], *(cell(got[i]) for i in impls), f"{any_row['sdpa_ms']:.3f}", *ratios]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "'kvq vs X' = X's time / kvq's (above 1: kvq is faster). Errors: ||out - ref|| / ||ref|| against an "
        "fp64 attention over the stored values, the larger of a check before and one after the timing; the "
        "tolerance is twice the unit roundoff of the narrowest type a kernel may round to "
        f"(bf16 for BF16 KV: {TOLERANCE['bf16']:.1e}; e4m3 for FP8 KV: {TOLERANCE['fp8_e4m3']:.1e}, as XQA's FP8 "
        "MMAs round q and P to e4m3; bf16 for kvq's own formats (K8V4, its V in groups of 32, INT4 per-token and group 64 / 32 asym), which no peer reads: '-').",
        "",
        "| model | batch x ctx | KV | " + " | ".join(f"{LABELS[i]} error" for i in impls) + " |",
        "|---" * (3 + len(impls)) + "|",
    ]
    for key in keys:
        errs = []
        for i in impls:
            r = by_key.get((*key, i))
            errs.append("-" if r is None else "failed" if "error" in r else f"{r['relerr']:.1e}")
        model = key[0] + (f" TP{key[1]}" if key[1] > 1 else "")
        lines.append(f"| {model} | {key[2]}x{key[3]} | {key[4]} | " + " | ".join(errs) + " |")
    details = sorted({f"{LABELS[r['impl']]}: {r['detail']}" for r in data if "detail" in r})
    failures = sorted({f"{LABELS[r['impl']]} {r['format']}: {r['error']}" for r in data if "error" in r})
    lines += ["", "Kernels that ran: " + "; ".join(details) + "."]
    if failures:
        lines += ["", "Failed: " + "; ".join(failures)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results", type=Path)
    ap.add_argument("--shapes", default=None, help="comma-separated MODEL[/tpN]:BATCHxCONTEXT (default: the grid)")
    ap.add_argument("--formats", default=None,
                    help=f"from {', '.join(FORMATS)} (default: all; --smoke: {', '.join(PEER_FORMATS)})")
    ap.add_argument("--impls", default=None, help=f"from {', '.join(IMPLEMENTATIONS)} (default: all on CUDA)")
    ap.add_argument("--page-size", type=int, default=PAGE_SIZE)
    ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, kvq under the Triton interpreter")
    ap.add_argument("--markdown", type=Path, default=None, help="only rebuild OUT/peers.md from this peers.jsonl")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.markdown:
        write_text(args.out / "peers.md", markdown([json.loads(x) for x in args.markdown.read_text().splitlines()]))
        return 0
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on the GPU machine, or pass --smoke for the CPU check")
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # read when runtime.kernels defines its kernels
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    shapes = [Shape.parse(s) for s in (args.shapes or ",".join(SMOKE_SHAPES if args.smoke else SHAPES)).split(",")]
    impls = (args.impls or ("kvq" if args.smoke else ",".join(IMPLEMENTATIONS))).split(",")
    # the smoke run checks the script on the formats the peers share (the tiny head_dim takes no group-64 scales)
    fmt_names = (args.formats or ",".join(PEER_FORMATS if args.smoke else FORMATS)).split(",")
    for name, known in ((impls, IMPLEMENTATIONS), (fmt_names, FORMATS)):
        if unknown := set(name) - set(known):
            raise SystemExit(f"unknown {', '.join(sorted(unknown))}: choose from {', '.join(known)}")
    rows = run(shapes, fmt_names, impls, args.page_size, args.out, device)
    print(markdown(rows))
    bad = [r for r in rows[1:] if not r["ok"]]
    for r in bad:
        why = r.get("error") or f"relerr {r['relerr']:.2e} > tolerance {r['tolerance']:.2e}"
        print(f"FAILED CHECK: {r['model']} {r['batch']}x{r['ctx']} {r['format']} {r['impl']}: {why}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
