"""Memory planner: what the KV cache costs and how many requests fit.

All KV arithmetic goes through runtime.kv_format.kv_bytes_per_token, the same
function the engine sizes its pool with, so the plan and the engine agree.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from recipes import Recipe
from runtime.config import ModelConfig, ceil_div
from runtime.errors import InputError, RecipeError, UnsupportedError
from runtime.kv_format import KVFormat, kv_bytes_per_token, resident_seqs, residual_bytes
from runtime.layer_formats import formats_name, uniform_format

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
GIB = 2**30
KIB = 2**10

# What the serving world compares against: the unquantized baseline, the
# per-tensor FP8/INT8 of TensorRT-LLM/vLLM, LMDeploy-style INT4, and kvq's
# K8V4 (K int8, V int4 asym) and group-64 INT4 (docs/kv-formats.md).
STANDARD_FORMATS = (
    KVFormat("fp16"),
    KVFormat("fp8_e4m3", "per_tensor"),
    KVFormat("int8", "per_tensor"),
    KVFormat("int8", "per_token"),
    KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False),
    KVFormat("int4", "per_token", symmetric=False),
    KVFormat("int4", "per_token", symmetric=False, group_size=64),
)


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"cannot read {text!r} as a size; write e.g. 141GB, 80GiB or 512MiB.")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass
class FormatPlan:
    format: str
    recipe_format: bool
    bytes_per_token: float  # whole model (all ranks)
    bytes_per_token_per_gpu: float
    kv_per_request_gib: dict[int, float]  # context -> GiB, whole model
    pool_tokens: int  # per GPU pool / per-GPU bytes per token
    max_concurrency: dict[int, int]  # context -> full-length requests held at once
    capacity_vs_baseline: float


@dataclass
class Plan:
    recipe: str
    model: str
    tp: int
    pp: int
    gpu_memory_bytes: int
    gpu_memory_fraction: float
    weights_bytes_per_gpu: int
    reserve_bytes_per_gpu: int
    pool_bytes_per_gpu: int
    contexts: list[int]
    formats: list[FormatPlan]

    def to_dict(self) -> dict:
        return asdict(self)


def weights_bytes_per_gpu(cfg: ModelConfig, dtype: str, tp: int, pp: int) -> int:
    return ceil_div(cfg.num_parameters * _WEIGHT_BYTES[dtype], tp * pp)


def _stores(fmt: KVFormat, cfg) -> bool:
    """Whether this model's heads can be stored in `fmt` (group sizes must divide head_dim)."""
    try:
        fmt.bytes_per_token_head(cfg.head_dim)
    except UnsupportedError:
        return False
    return True


def make_plan(
    recipe: Recipe,
    cfg: ModelConfig | None = None,
    contexts: list[int] | None = None,
    gpu_memory: int | None = None,
    gpus: int | None = None,
    reserve: int = 4 * GIB,
) -> Plan:
    cfg = cfg or recipe.geometry()
    if cfg is None:
        raise RecipeError(
            f"recipe {recipe.name}: `kvq plan` needs the model's geometry; set model.preset "
            "(e.g. --set model.preset=llama3-70b) or convert the model first."
        )
    tp, pp = recipe.build.tp, recipe.build.pp
    if gpus is not None:
        if gpus < 1 or gpus % pp:
            raise InputError(f"--gpus {gpus}: must be a positive multiple of pp ({pp}).")
        tp = gpus // pp
        if cfg.num_heads % tp:
            raise InputError(f"--gpus {gpus}: tensor parallelism {tp} must divide the {cfg.num_heads} heads.")
    contexts = contexts or [8192, 32768, 131072]
    mem = gpu_memory if gpu_memory is not None else parse_bytes("141GB")
    weights = weights_bytes_per_gpu(cfg, recipe.model.dtype, tp, pp)
    pool = max(0, int(mem * recipe.build.gpu_memory_fraction) - weights - reserve)

    # kv.dtype auto: the search stage decides the formats, so only the standard ones are planned
    mine = None if recipe.kv.dtype == "auto" else recipe.layer_formats(cfg.num_layers)
    if mine is not None and uniform_format(mine) is not None:
        mine = mine[0]
    fmts = [f for f in STANDARD_FORMATS if _stores(f, cfg)]  # e.g. group-64 scales need head_dim % 64 == 0
    if mine is not None and mine not in fmts:
        fmts.append(mine)
    base_bpt = kv_bytes_per_token(cfg, STANDARD_FORMATS[0], tp, pp)
    rows = []
    for f in fmts:
        total = kv_bytes_per_token(cfg, f)
        per_gpu = kv_bytes_per_token(cfg, f, tp, pp)
        # per-channel keys: one fp16 residual block per resident sequence comes out of the pool, for at most
        # max_batch_size sequences and no more than fit (kv_format.resident_seqs), as the engine allocates them
        batch, one = recipe.build.max_batch_size, residual_bytes(cfg, f, 1, tp, pp)
        conc = {c: resident_seqs(pool, c * per_gpu, one, batch) for c in contexts}
        tokens = int(max(0, pool - residual_bytes(cfg, f, min(batch, conc[min(contexts)]), tp, pp)) // per_gpu)
        if not one:
            conc = {c: tokens // c for c in contexts}
        rows.append(FormatPlan(
            format=formats_name(f) if isinstance(f, tuple) else f.name,
            recipe_format=(f == mine),
            bytes_per_token=total,
            bytes_per_token_per_gpu=per_gpu,
            kv_per_request_gib={c: total * c / GIB for c in contexts},
            pool_tokens=tokens,
            max_concurrency=conc,
            capacity_vs_baseline=base_bpt / per_gpu,
        ))
    return Plan(recipe.name, recipe.model.preset or recipe.model.path or "?", tp, pp, mem,
                recipe.build.gpu_memory_fraction, weights, reserve, pool, contexts, rows)


def render_plan(plan: Plan) -> str:
    """Markdown-ish plain text for the terminal and reports."""
    ctx = plan.contexts
    head = (f"recipe {plan.recipe} ({plan.model}), TP{plan.tp} x PP{plan.pp}, "
            f"{plan.gpu_memory_bytes / 1e9:.0f} GB per GPU x {plan.gpu_memory_fraction:.2f}: "
            f"weights {plan.weights_bytes_per_gpu / GIB:.1f} GiB/GPU, reserve "
            f"{plan.reserve_bytes_per_gpu / GIB:.1f} GiB, KV pool {plan.pool_bytes_per_gpu / GIB:.1f} GiB/GPU")
    cols = ["KV format", "KiB/token", "KiB/token/GPU"] + [f"GiB/req @{c // 1024}k" for c in ctx] + \
        ["pool tokens/GPU"] + [f"max req @{c // 1024}k" for c in ctx] + ["x requests"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in plan.formats:
        cells = [r.format + (" *" if r.recipe_format else ""), f"{r.bytes_per_token / KIB:.1f}",
                 f"{r.bytes_per_token_per_gpu / KIB:.1f}"]
        cells += [f"{r.kv_per_request_gib[c]:.2f}" for c in ctx]
        cells += [f"{r.pool_tokens:,}"] + [str(r.max_concurrency[c]) for c in ctx]
        cells += [f"{r.capacity_vs_baseline:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    if plan.pool_bytes_per_gpu == 0:
        lines.append("\nThe weights do not leave room for a KV pool: add GPUs (--gpus N) or use a larger GPU.")
    lines.append("\n* = this recipe's KV format. Per-token formats include their scale (and zero-point) bytes; "
                 "per-channel keys their blocks' channel scales and one fp16 key block per resident sequence "
                 "(at most build.max_batch_size): pool tokens are what is left beside the residual of the "
                 "shortest context's requests.")
    return "\n".join(lines)
