"""Peak memory of kvq's streaming converters on a multi-GB checkpoint.

Claim under test: converting holds one tensor (or one rank's slice of it) at a
time, so peak RSS is a small multiple of the largest tensor whatever the model
size. The script

1. synthesizes a Hugging Face Llama checkpoint on disk (default: Llama-3-8B
   geometry cut to 4 layers, bf16, ~3.9 GB; largest tensor = the 1.05 GB
   embedding), written tensor by tensor with kvq's streaming writer;
2. in a fresh process, runs the `convert` stage on it (bf16 -> fp16 cast);
3. in a fresh process, writes a TensorRT-LLM checkpoint at tp 2 with INT8 KV
   scales from the converted directory;

and records each child's peak RSS (VmHWM, which counts the file pages
safetensors maps too) next to the checkpoint and largest-tensor
sizes, as one JSON row. Files are deleted at the end.

    python -m benchmarks.convert_memory [--layers 4] [--workdir DIR] [--out benchmarks/results/convert_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _peak_rss_bytes() -> int:
    """VmHWM: this process's peak resident set (anonymous + file pages it mapped).

    Not getrusage's ru_maxrss: Linux carries that across fork+exec, so a child
    would report the parent's peak from synthesizing the checkpoint.
    """
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def synthesize(src: Path, layers: int) -> dict:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from builder.convert.llama_names import hf_tensor_shapes
    from builder.convert.writer import TensorSpec, write_streaming
    from calibration.files import write_json_atomic
    from runtime.config import preset

    cfg = preset("llama3-8b").replace(num_layers=layers)
    src.mkdir(parents=True)
    specs = [TensorSpec(n, s, torch.bfloat16) for n, s in hf_tensor_shapes(cfg).items()]
    gen = torch.Generator().manual_seed(0)
    nbytes = write_streaming(src / "model.safetensors", specs,
                             lambda s: torch.empty(s.shape, dtype=torch.bfloat16).normal_(0, 0.02, generator=gen))
    write_json_atomic(src / "config.json", cfg.to_hf_dict("bfloat16"))
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(str(src))
    return {"checkpoint_bytes": nbytes, "largest_tensor_bytes": max(s.nbytes for s in specs),
            "num_tensors": len(specs), "geometry": f"llama3-8b x {layers} layers"}


def child(phase: str, src: Path, dst: Path) -> None:
    import torch

    from builder.convert import convert_source
    from builder.trtllm import write_trtllm_checkpoint

    baseline = _peak_rss_bytes()  # after imports (torch, transformers are not small)
    dst.mkdir()
    start = time.monotonic()
    if phase == "convert":
        facts = convert_source("hf", str(src), dst, "fp16")
    else:
        layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
        amax = torch.linspace(1.0, 20.0, layers)
        facts = write_trtllm_checkpoint(src, dst, "fp16", tp=2, pp=1, kv_dtype="int8", k_amax=amax, v_amax=amax)
    print(json.dumps({"phase": phase, "seconds": round(time.monotonic() - start, 1),
                      "baseline_rss_bytes": baseline, "peak_rss_bytes": _peak_rss_bytes(),
                      "output_bytes": facts["weight_bytes"]}))


def run_child(phase: str, src: Path, dst: Path) -> dict:
    out = subprocess.run([sys.executable, "-m", __spec__.name, "--child", phase, str(src), str(dst)],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--workdir", default=None, help="where the temporary checkpoints go (needs ~3x the size)")
    ap.add_argument("--out", default=None, help="write the JSON row here as well")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return
    work = Path(tempfile.mkdtemp(prefix="kvq-convert-mem-", dir=args.workdir))
    try:
        t0 = time.monotonic()
        row = synthesize(work / "hf", args.layers)
        row["synthesize_seconds"] = round(time.monotonic() - t0, 1)
        phases = [run_child("convert", work / "hf", work / "converted"),
                  run_child("trtllm_tp2", work / "converted", work / "trtllm")]
        for p in phases:
            p["peak_over_largest_tensor"] = round(p["peak_rss_bytes"] / row["largest_tensor_bytes"], 2)
            p["peak_over_checkpoint"] = round(p["peak_rss_bytes"] / row["checkpoint_bytes"], 3)
        import torch

        row.update(phases=phases, machine=f"{platform.machine()} {os.cpu_count()} cores, {platform.system()}",
                   python=platform.python_version(), torch=torch.__version__,
                   date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(row, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
