"""Served vs in-process: synthetic engines through the real tritonserver and called directly, in one run.

Two comparisons in one command (GPU, H200):
  * the deployment: Llama-3-8B geometry (recipes synthetic-8b-fp16kv / -fp8kv), BF16 and FP8 per-token KV,
    256 concurrent requests (the recipes' max_batch_size), through every served path and in-process;
  * per-layer KV formats (--kv-layers FILE, the search stage's recipe_kv.yaml or kv_format.json; default
    served_kv_layers_smollm2.yaml, the H200 search's choice for SmolLM2 at +1%): that choice on the
    SmolLM2-135M geometry against BF16 and each format it uses as a uniform engine, same concurrency,
    served (gRPC streams to kvq_engine) and in-process (benchmarks/served_layer_formats.py).
The GPU machine has torch, transformers and numpy; tritonserver, tritonclient/grpcio, pydantic and the
OpenAI stack travel in .whl/serve (wheels plus pytriton-slim-*.tar.xz, benchmarks/pack_pytriton.py):

    pip install -q --no-index --no-deps --target /tmp/site .whl/serve/*.whl
    tar -xJf .whl/serve/pytriton-slim-0.7.0-py312.tar.xz -C /tmp/site
    PYTHONPATH=/tmp/site:. python -m benchmarks.served_vs_inprocess --out $OUT

The python backend's stub imports what this process imports (triton_repo/server.py gives it the
same sys.path), so nothing needs installing into the machine's own environment. The stub needs
numpy < 2, carried first on the path; serving loads tokenizers without AutoTokenizer
(runtime/tokenizer.py), so nothing on this path imports sklearn or scipy built for the image's numpy 2.

CPU proof (tiny model, seconds of generation; tests/data/tiny_kv_layers.yaml is a per-layer choice for it):

    python -m benchmarks.served_vs_inprocess --preset tiny-llama3 --device cpu \\
        --concurrency 4 --prompt-len 16 --output-len 32 --block-size 16 --layer-preset tiny-llama3 \\
        --kv-layers tests/data/tiny_kv_layers.yaml --out /tmp/svi

For each engine, the same engine directory (random weights from a seed, so every path computes
the same tokens) is driven with the same prompts, all requests at once (one wave), greedy:
  * served paths, through one tritonserver: `engine` = gRPC streams straight to kvq_engine with token
    ids (grpc.aio, one client thread); `ensemble` = text through preprocessing -> kvq_engine ->
    postprocessing, with `kvq bench`'s client (triton_repo.bench); `openai` = streamed completions
    from the OpenAI frontend (its own process) with the real `openai` client;
  * `inprocess` = the engine in this process (builder.loadgen, the `kvq compare` load loop),
    after the server has exited and freed the GPU.
Decode throughput is measured in the window where every request is decoding (after the last first
token, before the first request ends); TTFT and inter-token latency per request. The gaps between
paths say where throughput goes: inprocess -> engine is the python backend and one response per
token; engine -> ensemble adds tokenization and per-token detokenization models; engine -> openai
the HTTP frontend. Client CPU time per wall second is recorded so a saturated client shows.
Rows: OUT/served_vs_inprocess.jsonl (`part`: deployment / per-layer); tables: OUT/served_vs_inprocess.md;
each server's log: OUT/logs/tritonserver-ENGINE.log.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks import served_layer_formats as layered
from runtime.config import PRESETS
from runtime.engine_dir import parse_kv_format_name
from runtime.errors import InputError, KvqError
from runtime.layer_formats import LayerFormats, formats_name, formats_to_json

REPO = Path(__file__).resolve().parents[1]
DEPLOYMENT_FORMATS = "bf16,fp8_e4m3-per_token"  # the synthetic-8b recipes' KV formats
KV_LAYERS = Path(__file__).with_name("served_kv_layers_smollm2.yaml")  # SmolLM2's choice at +1% (H200 search)


# ------------------------------------------------------------------ the engine
def word_tokenizer(vocab_size: int, out: Path) -> None:
    """A tokenizer with one word per id ("w0" .. "wN"): synthetic engines have none, the served
    path needs one, and "w17 w42" must encode to exactly [17, 42] so every path sees the same ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0").save_pretrained(str(out))


def make_engine_dir(root: Path, name: str, formats: LayerFormats, preset: str, args) -> Path:
    """A synthetic engine of `preset` (weights from seed 0: the same for every format) storing `formats`."""
    from safetensors.torch import save_file

    cfg = PRESETS[preset]
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg.to_hf_dict("bfloat16")))
    (d / "synthetic.json").write_text(json.dumps({"seed": 0}))
    (d / "kv_format.json").write_text(json.dumps(formats_to_json(formats)))
    scales = layered.static_scales(d, formats, root / f"calibration-{preset}", args.device)
    if scales:
        save_file(scales, str(d / "kv_scales.safetensors"))
    # max_input_len twice the prompt: the ensemble bounds text in bytes (max_input_len x the longest token)
    # before it tokenizes, and the spaces between this tokenizer's words count too
    (d / "engine.json").write_text(json.dumps({
        "max_batch_size": args.concurrency, "max_input_len": 2 * args.prompt_len,
        "max_seq_len": 2 * args.prompt_len + args.output_len, "block_size": args.block_size,
        # half the GPU each: the served and the in-process engine never overlap, but equal pools
        "gpu_memory_fraction": 0.5,
    }))
    word_tokenizer(cfg.vocab_size, d)
    return d


def prompts(args, vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, vocab, size=(n, length)).tolist()


def as_text(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


# ------------------------------------------------------------------ measures
def summarize(path: str, runs: list[tuple[float, list[float]]], wall: float, cpu: float | None,
              steps: dict[int, int] | None) -> dict:
    """runs: per request (send time, token arrival times)."""
    firsts = [t[0] for _, t in runs if t]
    lasts = [t[-1] for _, t in runs if t]
    tokens = sum(len(t) for _, t in runs)
    lo, hi = (max(firsts), min(lasts)) if firsts else (0.0, 0.0)
    in_window = sum(1 for _, t in runs for x in t if lo < x <= hi)
    itl = [b - a for _, t in runs for a, b in zip(t, t[1:])]
    ttft = [t[0] - s for s, t in runs if t]
    ms = lambda v, q: float(np.percentile(v, q) * 1e3) if v else float("nan")  # noqa: E731
    row = {
        "path": path, "requests": len(runs), "completed": sum(1 for _, t in runs if t), "tokens": tokens,
        "wall_s": wall, "tokens_per_s": tokens / wall if wall > 0 else float("nan"),
        "decode_tokens_per_s": in_window / (hi - lo) if hi > lo else float("nan"),
        "decode_window_s": max(0.0, hi - lo),
        "ttft_ms_p50": ms(ttft, 50), "ttft_ms_p99": ms(ttft, 99),
        "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
        "client_cpu_per_wall": cpu / wall if cpu is not None and wall > 0 else None,
    }
    if steps:
        n = sum(steps.values())
        row.update(engine_steps=n, mean_batch=sum(b * c for b, c in steps.items()) / n if n else float("nan"))
    return row


def _step_delta(before: dict, after: dict) -> dict[int, int]:
    a, b = after["steps_by_batch_size"], before["steps_by_batch_size"]
    return {k: a[k] - b.get(k, 0) for k in a if a[k] > b.get(k, 0)}


def run_inprocess(engine_dir: Path, ids: list[list[int]], warm: list[list[int]], args) -> dict:
    import torch

    from builder.loadgen import run_closed_loop
    from runtime.engine import Engine
    from runtime.sampling import SamplingParams

    engine = Engine.from_dir(engine_dir, device=args.device)
    try:
        run_closed_loop(engine, warm, SamplingParams(max_tokens=4), args.concurrency)
        run_closed_loop(engine, ids, SamplingParams(max_tokens=4), args.concurrency)
        before = len(engine.stats.step_batch_sizes)
        cpu0, t0 = time.process_time(), time.perf_counter()
        res = run_closed_loop(engine, ids, SamplingParams(max_tokens=args.output_len), args.concurrency,
                              keep_traces=True)
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        sizes = engine.stats.step_batch_sizes[before:]
        steps = {b: sizes.count(b) for b in set(sizes)}
        row = summarize("inprocess", res["traces"], wall, cpu, steps)
        row.update(cuda_graphs=engine.stats.cuda_graphs, attention=engine.stats.attention,
                   kv_bytes_per_token=engine.stats.kv_bytes_per_token, warm_up_s=engine.stats.warm_up_s,
                   serving_compiles=engine.stats.serving_compiles)
        return row
    finally:
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


async def _engine_streams(grpc_url: str, ids: list[list[int]], max_tokens: int, concurrency: int):
    from triton_repo.openai_api.triton_stream import EngineRequest, TritonStreams, discover

    model = discover(grpc_url)
    streams = TritonStreams(grpc_url, model)
    await streams.open()
    gate = asyncio.Semaphore(concurrency)

    async def one(p):
        async with gate:
            sent, times = time.perf_counter(), []
            async for step in streams.generate(EngineRequest(p, max_tokens, 0.0, 1.0)):
                times += [time.perf_counter()] * len(step.ids)
            return sent, times

    try:
        return await asyncio.gather(*(one(p) for p in ids))
    finally:
        await streams.close()


def measure_served(name, server, ids, warm, args, frontend_url=None, first=False) -> dict:
    from triton_repo import client
    from triton_repo.bench import run_bench

    def go(ps, max_tokens, keep):
        """The requests' (send time, token times) and the client's CPU seconds while they ran."""
        if name == "engine":
            cpu0 = time.process_time()
            runs = asyncio.run(_engine_streams(server.grpc_url, ps, max_tokens, args.concurrency))
            return runs, time.process_time() - cpu0
        url, kw = (frontend_url, {"openai": True, "model": "synthetic"}) if name == "openai" else (server.grpc_url, {})
        res = run_bench(url, args.concurrency, len(ps), max_tokens=max_tokens, prompts=[as_text(p) for p in ps],
                        apply_chat_template=False, temperature=0.0, keep_token_times=keep, timeout_s=600,
                        processes=args.client_processes, **kw)
        if res["summary"]["errors"]:
            raise SystemExit(f"{name}: {res['summary']['error_messages']}")
        # a response may carry several tokens; this tokenizer's tokens are its words, so count them exactly
        runs = [(r["start"], [t for t, text in zip(r["token_times"], r["token_texts"]) for _ in text.split()])
                for r in res["requests"]] if keep else None
        return runs, res["summary"]["client_cpu_s"]

    go(warm, 4, False)  # this path's client and the engine's batch shapes
    if first:
        go(ids, 4, False)  # the measured prompts' prefill shapes, once per server
    time.sleep(1.2)  # kvq_engine publishes its counters every 0.1 s: let them count the warm-up's last steps
    before = client.engine_metrics(server.metrics_url)
    runs, cpu = go(ids, args.output_len, True)
    # the load's span, from the first send to the last token: not the client processes' start-up
    wall = max((t[-1] for _, t in runs if t), default=0.0) - min((s for s, _ in runs), default=0.0)
    time.sleep(1.2)
    after = client.engine_metrics(server.metrics_url)
    row = summarize(name, runs, wall, cpu if name != "openai" else None, _step_delta(before, after))
    row["engine_tokens"] = after["generated_tokens"] - before["generated_tokens"]  # the server's own count
    return row


def start_frontend(grpc_url: str, port: int) -> subprocess.Popen:
    """The OpenAI frontend in its own process (its own GIL), importing what this process imports."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "triton_repo.openai_api.runner", "--grpc-url", grpc_url,
                             "--port", str(port), "--model", "synthetic"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    seen = []  # warnings (e.g. transformers' about a tokenizer) may come before the ready line
    while (line := proc.stdout.readline()) and not line.startswith("openai:"):
        seen.append(line)
    if not line:
        proc.kill()
        raise SystemExit(f"the OpenAI frontend did not start: {''.join(seen)}")
    return proc


@contextlib.contextmanager
def keep_log(server, name: str, out: Path):
    """The server's log beside the results, whatever happens (the temporary directory goes)."""
    try:
        yield
    finally:
        (out / "logs").mkdir(exist_ok=True)
        shutil.copy(server.log_path, out / "logs" / f"tritonserver-{name}.log")


def run_format(name: str, formats: LayerFormats, preset: str, paths: list[str], work: Path, args) -> list[dict]:
    """One engine through one tritonserver on each of `paths`, then in-process: its rows."""
    from triton_repo.repo_torch import write_repository
    from triton_repo.server import free_port, start_server

    engine_dir = make_engine_dir(work, name, formats, preset, args)
    vocab = PRESETS[preset].vocab_size
    ids = prompts(args, vocab, args.requests, args.prompt_len, seed=1)
    warm = prompts(args, vocab, args.concurrency, min(16, args.prompt_len), seed=2)
    repo = work / f"repo-{name}"
    repo.mkdir()
    write_repository(engine_dir, repo, {"device": args.device})
    rows = []
    t = time.perf_counter()
    server = start_server(repo, log_dir=work, ready_timeout_s=900)
    with keep_log(server, name, args.out), server:  # the log is copied after the server has stopped
        print(f"[{name}] tritonserver ready in {time.perf_counter() - t:.0f} s", flush=True)
        for i, path in enumerate(paths):
            fe = None
            try:
                if path == "openai":
                    port = free_port()
                    fe = start_frontend(server.grpc_url, port)
                url = f"http://127.0.0.1:{port}/v1" if fe else None
                rows.append(measure_served(path, server, ids, warm, args, url, first=i == 0))
            finally:
                if fe is not None:
                    fe.terminate()
                    fe.wait(timeout=30)
            print(f"[{name}] {rows[-1]}", flush=True)
    rows.append(run_inprocess(engine_dir, ids, warm, args))
    print(f"[{name}] {rows[-1]}", flush=True)
    inproc = rows[-1]
    base = inproc["decode_tokens_per_s"]
    for r in rows:
        # the server loads the same directory on the same device, so it runs the same attention ops
        r.update(engine=name, kv_format=formats_name(formats), preset=preset, device=args.device,
                 concurrency=args.concurrency, prompt_len=args.prompt_len, output_len=args.output_len,
                 attention=inproc["attention"], kv_bytes_per_token=inproc["kv_bytes_per_token"],
                 decode_vs_inprocess=r["decode_tokens_per_s"] / base if base else float("nan"),
                 all_vs_inprocess=r["tokens_per_s"] / inproc["tokens_per_s"] if inproc["tokens_per_s"] else float("nan"))
    return rows


def markdown(rows: list[dict], args, machine: str) -> str:
    if not rows:
        return ""
    head = (f"## Served vs in-process: {args.preset} geometry (synthetic weights), {args.concurrency} concurrent "
            f"requests, {args.prompt_len} prompt + {args.output_len} output tokens, greedy\n\n{machine}\n\n"
            "| KV | path | decode tok/s | vs in-process | tok/s (all) | vs in-process | tokens: client / server "
            "| TTFT p50 / p99 ms | ITL p50 / p99 ms | mean batch | client CPU/s |\n"
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
    f = lambda v, p=1: "-" if v is None or v != v else f"{v:,.{p}f}"  # noqa: E731
    body = "".join(
        f"| {r['kv_format']} | {r['path']} | {f(r['decode_tokens_per_s'])} | {f(100 * r['decode_vs_inprocess'])}% "
        f"| {f(r['tokens_per_s'])} | {f(100 * r['all_vs_inprocess'])}% | {r['tokens']:,} / {f(r.get('engine_tokens'), 0)} "
        f"| {f(r['ttft_ms_p50'])} / {f(r['ttft_ms_p99'])} "
        f"| {f(r['itl_ms_p50'], 2)} / {f(r['itl_ms_p99'], 2)} | {f(r.get('mean_batch'))} "
        f"| {f(r['client_cpu_per_wall'], 2)} |\n" for r in rows)
    return head + body


def engines_to_serve(args) -> list[tuple[str, str, LayerFormats, str, list[str]]]:
    """(part, engine name, formats, preset, served paths) for every engine, checked before a server starts."""
    plan = [("deployment", n, (parse_kv_format_name(n),) * PRESETS[args.preset].num_layers, args.preset,
             [p for p in args.paths.split(",") if p != "openai" or args.openai])
            for n in filter(None, args.formats.split(","))]
    if args.kv_layers != "none":
        num_layers = PRESETS[args.layer_preset].num_layers
        chosen = layered.read_layer_formats(Path(args.kv_layers), num_layers)
        uniform = None if args.layer_uniform is None else [
            parse_kv_format_name(n) for n in args.layer_uniform.split(",") if n]
        layer_paths = [p for p in args.layer_paths.split(",") if p]
        known = ["engine", "ensemble"] + (["openai"] if args.openai else [])
        if not layer_paths or set(layer_paths) - set(known):
            raise InputError(f"--layer-paths {args.layer_paths!r}: give one or more of {', '.join(known)}.")
        plan += [("per-layer", f"L-{label}", formats, args.layer_preset, layer_paths)
                 for label, formats in layered.comparison(chosen, uniform)]
    return plan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b", choices=sorted(PRESETS), help="the deployment's geometry")
    ap.add_argument("--formats", default=DEPLOYMENT_FORMATS, help="the deployment's KV formats ('' skips it)")
    ap.add_argument("--kv-layers", default=str(KV_LAYERS),
                    help="a per-layer choice (search/recipe_kv.yaml, a recipe with kv.layers, or kv_format.json) "
                    f"served against each format it uses, uniform; 'none' skips it (default: benchmarks/{KV_LAYERS.name})")
    ap.add_argument("--layer-preset", default="smollm2-135m", choices=sorted(PRESETS),
                    help="the per-layer comparison's geometry (the model the choice was made for)")
    ap.add_argument("--layer-uniform", default=None,
                    help="the uniform formats beside the choice (default: bf16 and every format the choice uses)")
    ap.add_argument("--layer-paths", default="engine", help="served paths of the per-layer comparison")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--concurrency", type=int, default=256, help="the synthetic-8b recipes' max_batch_size")
    ap.add_argument("--requests", type=int, default=None, help="default: one wave (= concurrency)")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=64, help="the synthetic-8b recipes' block_size")
    ap.add_argument("--paths", default="engine,ensemble,openai", help="served paths of the deployment")
    ap.add_argument("--no-openai", dest="openai", action="store_false", help="skip the OpenAI frontend path")
    ap.add_argument("--client-processes", type=int, default=1,
                    help="client processes of the ensemble and openai paths (run_bench's processes)")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.requests = args.requests or args.concurrency
    if not args.paths or set(args.paths.split(",")) - {"engine", "ensemble", "openai"}:
        raise SystemExit(f"--paths {args.paths!r}: give one or more of engine, ensemble, openai.")
    if args.openai:
        try:
            import fastapi  # noqa: F401
            import openai  # noqa: F401
            import uvicorn  # noqa: F401
        except ImportError as e:
            print(f"no OpenAI stack here ({e}); measuring without the openai path", flush=True)
            args.openai = False
    # (part, engine name, formats, preset, served paths), all checked before the first server starts
    try:
        plan = engines_to_serve(args)
    except KvqError as e:
        raise SystemExit(f"error: {e}") from None
    if not plan:
        raise SystemExit("nothing to measure: --formats is empty and --kv-layers is none.")
    machine = f"host {platform.node()}, {os.cpu_count()} CPUs, device {args.device}"
    if args.device.startswith("cuda"):
        import torch

        machine += f" ({torch.cuda.get_device_name()}, torch {torch.__version__})"
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvq-svi-") as tmp:
        for part, name, formats, preset, paths in plan:
            t = time.perf_counter()
            got = run_format(name, formats, preset, paths, Path(tmp), args)
            for r in got:
                r.update(part=part, engine=name.removeprefix("L-"), engine_s=time.perf_counter() - t)
            rows += got
            text = write_outputs(rows, args, machine, time.perf_counter() - t0)  # after each engine
    print(text)


def write_outputs(rows: list[dict], args, machine: str, elapsed: float) -> str:
    (args.out / "served_vs_inprocess.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    text = ("# Served vs in-process\n\n"
            + markdown([r for r in rows if r["part"] == "deployment"], args, machine)
            + layered.markdown([r for r in rows if r["part"] == "per-layer"], machine)
            + f"\nWhole run: {elapsed:.0f} s.\n")
    (args.out / "served_vs_inprocess.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
