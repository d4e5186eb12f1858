"""The recipe schema: one validated object per `--recipe NAME`.

Every section forbids unknown keys, so a typo is an error rather than a
silently ignored option (the failure mode of flag-soup build scripts).
Cross-field rules live in `Recipe._check` and say what to change.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.config import PRESETS, ModelConfig
from runtime.errors import UnsupportedError
from runtime.kv_format import GRANULARITIES, GROUP_SIZES, KV_DTYPES, SCALE_DTYPES, KVFormat, format_from_name

KVDtype = Literal[KV_DTYPES]  # type: ignore[valid-type]
Granularity = Literal[GRANULARITIES]  # type: ignore[valid-type]
ScaleDtype = Literal[SCALE_DTYPES]  # type: ignore[valid-type]
GroupSize = Literal[GROUP_SIZES]  # type: ignore[valid-type]

# TensorRT-LLM's engine path stores one per-tensor scale per layer and knows only
# INT8 and FP8 (e4m3) KV besides the unquantized baseline (trtllm.md §1.1-1.3).
TRTLLM_KV_DTYPES = ("fp16", "bf16", "int8", "fp8_e4m3")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelSection(Section):
    source: Literal["hf", "gguf", "builtin", "synthetic"] = Field(
        description="hf: a Hugging Face directory; gguf: a .gguf file; builtin: a model shipped by an "
        "installed package (smollm2-135m); synthetic: random weights of a preset geometry."
    )
    path: str | None = Field(None, description="Weights directory (hf) or file (gguf).")
    preset: str | None = Field(
        None, description="Geometry name (runtime.config.PRESETS): needed for builtin/synthetic; for hf it "
        "lets `kvq plan` work without weights and is checked against config.json."
    )
    dtype: Literal["fp32", "bf16", "fp16"] = "bf16"


class KVSection(Section):
    """How K and V are stored. dtype / symmetric / group_size apply to both unless k_* / v_* give one of
    them its own (e.g. k_dtype: int8, v_dtype: int4, v_symmetric: false: "K8V4"); or `format` names a
    whole format (KVFormat.name, e.g. k.int8-per_token+v.int4-per_token-asym) instead of the fields."""

    format: str | None = Field(None, description="A KV format name (docs/kv-formats.md), instead of the fields.")
    dtype: KVDtype = "fp16"
    granularity: Granularity = "per_tensor"
    symmetric: bool = True
    scale_dtype: ScaleDtype = "float16"
    group_size: GroupSize = Field(0, description="per_token: one scale (and zero) per group of this many "
                                  "channels of a head; 0: one per token-head.")
    k_dtype: KVDtype | None = None
    v_dtype: KVDtype | None = None
    k_symmetric: bool | None = None
    v_symmetric: bool | None = None
    k_group_size: GroupSize | None = None
    v_group_size: GroupSize | None = None
    clamp_fp8_scales_to_one: bool = Field(
        False, description="Reproduce ModelOpt's TensorRT-LLM export, which clamps FP8 KV scales to >= 1.0."
    )

    @model_validator(mode="after")
    def _one_spelling(self) -> "KVSection":
        fields = self.model_fields_set - {"format", "clamp_fp8_scales_to_one"}
        if self.format is not None and fields:
            raise ValueError(f"kv.format names the whole format; drop kv.{', kv.'.join(sorted(fields))} "
                             "or kv.format.")
        return self

    def to_format(self) -> KVFormat:
        if self.format is not None:
            return format_from_name(self.format)

        def pick(own, shared):
            return shared if own is None else own

        return KVFormat(
            pick(self.k_dtype, self.dtype), self.granularity, pick(self.k_symmetric, self.symmetric),
            self.scale_dtype, pick(self.k_group_size, self.group_size), pick(self.v_dtype, self.dtype),
            pick(self.v_symmetric, self.symmetric), pick(self.v_group_size, self.group_size),
        )


class CalibrationSection(Section):
    dataset: str = Field("builtin", description="'builtin' (stdlib docstrings) or a .txt/.jsonl file or directory.")
    num_samples: int = Field(64, ge=1)
    seq_len: int = Field(512, ge=16)
    policy: Literal["max", "percentile", "mse"] = "max"
    percentile: float = Field(99.99, gt=0, le=100)
    seed: int = 0
    streaming: bool = Field(False, description="Layer-streaming: one decoder layer resident at a time.")


class BuildSection(Section):
    max_batch_size: int = Field(8, ge=1)
    max_input_len: int = Field(1024, ge=1)
    max_seq_len: int = Field(2048, ge=2)
    max_num_tokens: int = Field(8192, ge=1)
    tp: int = Field(1, ge=1)
    pp: int = Field(1, ge=1)
    trtllm_version: str | None = Field(
        None, description="backend tensorrt-llm: the TensorRT-LLM release that will build the engine, when it "
        "is not installed here (decides whether a pp that does not divide the layers is safe).")
    block_size: int = Field(32, ge=1, le=1024)
    gpu_memory_fraction: float = Field(0.9, gt=0, le=1)
    cuda_graphs: bool = Field(True, description="Embedded engine on CUDA: decode steps replay CUDA graphs.")
    batch_invariant: bool | None = Field(
        None, description="Embedded engine: a request's output independent of its batch mates, chunking and "
        "preemption (docs/numerics.md). Unset: on for CPU engines, off on CUDA.")
    prefix_caching: bool = Field(
        True, description="Keep finished requests' full KV pages and reuse them for requests that start with "
        "the same tokens (docs/prefix_caching.md).")


class AccuracySection(Section):
    max_perplexity_increase_pct: float = Field(1.0, ge=0)
    min_passkey_rate_relative: float = Field(0.9, ge=0, le=1.5)
    min_greedy_agreement: float = Field(0.8, ge=0, le=1)
    perplexity_tokens: int = Field(1024, ge=32)
    greedy_prompts: int = Field(4, ge=1)
    greedy_tokens: int = Field(32, ge=1)
    passkey_lengths: list[int] = Field(default_factory=lambda: [256, 1024])
    passkey_trials: int = Field(20, ge=1)
    eval_data: str = Field("builtin", description="Held-out text for perplexity: 'builtin' (the built-in corpus's "
                           "evaluation split) or your own .txt/.jsonl file or directory, to gate on your domain.")
    enabled: bool = True


class DeploySection(Section):
    instance_count: int = Field(1, ge=1)
    max_queue_delay_us: int = Field(1000, ge=0)
    streaming: bool = True
    enabled: bool = True


class CompareSection(Section):
    variants: list[str] = Field(default_factory=list, description="Recipes built and compared side by side.")
    prompt_len: int = Field(128, ge=1)
    output_len: int = Field(32, ge=1)
    concurrency: list[int] = Field(default_factory=lambda: [1, 4])
    num_requests: int = Field(8, ge=1)
    seed: int = 0
    memory_budget: str | None = Field(None, description="KV pool budget for every engine, e.g. '256MiB'.")
    enabled: bool = True


class Recipe(Section):
    name: str
    description: str = ""
    backend: Literal["torch", "tensorrt-llm"] = "torch"
    model: ModelSection
    kv: KVSection = Field(default_factory=KVSection)
    calibration: CalibrationSection = Field(default_factory=CalibrationSection)
    build: BuildSection = Field(default_factory=BuildSection)
    accuracy: AccuracySection = Field(default_factory=AccuracySection)
    deploy: DeploySection = Field(default_factory=DeploySection)
    compare: CompareSection = Field(default_factory=CompareSection)

    @model_validator(mode="after")
    def _check(self) -> "Recipe":
        m, kv, b = self.model, self.kv, self.build
        if m.source in ("hf", "gguf") and not m.path:
            raise ValueError(f"model.path: source {m.source!r} needs a path to the weights (--set model.path=...).")
        if m.source in ("builtin", "synthetic") and not m.preset:
            raise ValueError(f"model.preset: source {m.source!r} needs a preset; choose one of {sorted(PRESETS)}.")
        if m.preset is not None and m.preset not in PRESETS:
            raise ValueError(f"model.preset: unknown preset {m.preset!r}; choose one of {sorted(PRESETS)}.")
        if m.source == "builtin" and m.preset != "smollm2-135m":
            raise ValueError("model.preset: the only builtin model is 'smollm2-135m'.")
        try:
            fmt = kv.to_format()
        except UnsupportedError as e:
            raise ValueError(f"kv: {e}") from None
        if self.backend == "tensorrt-llm":
            _check_trtllm_kv(fmt)
            if fmt.dtype == "int4":
                raise ValueError(
                    "kv.dtype: TensorRT-LLM has no INT4 KV cache (its engine path stores INT8 or FP8 KV); "
                    "use backend: torch for int4, or kv.dtype: fp8_e4m3 / int8 with TensorRT-LLM."
                )
            if fmt.dtype not in TRTLLM_KV_DTYPES:
                raise ValueError(
                    f"kv.dtype: TensorRT-LLM's engine path takes {', '.join(TRTLLM_KV_DTYPES)}, not "
                    f"{fmt.dtype!r}; use backend: torch for it."
                )
            if fmt.dtype in ("int8", "fp8_e4m3") and fmt.granularity != "per_tensor":
                raise ValueError(
                    "kv.granularity: TensorRT-LLM stores one KV scale per layer (per_tensor); use "
                    "granularity: per_tensor, or backend: torch for per_head / per_token scales."
                )
        if kv.clamp_fp8_scales_to_one and not (not fmt.split and fmt.is_fp8 and fmt.static):
            raise ValueError("kv.clamp_fp8_scales_to_one applies only to static fp8 scales (per_tensor/per_head).")
        if b.max_input_len > b.max_seq_len:
            raise ValueError(
                f"build.max_input_len ({b.max_input_len}) exceeds build.max_seq_len ({b.max_seq_len}); "
                "raise max_seq_len or lower max_input_len."
            )
        if self.backend == "torch" and (b.tp > 1 or b.pp > 1):
            raise ValueError("build.tp/pp: the embedded torch engine runs on one device; set tp: 1 and pp: 1 "
                             "(tp/pp apply to backend: tensorrt-llm and to `kvq plan`).")
        geo = self.geometry()
        if geo is not None:
            self._check_geometry(geo)
        return self

    def _check_geometry(self, geo: ModelConfig) -> None:
        b = self.build
        if geo.num_heads % b.tp:
            raise ValueError(
                f"build.tp: tensor parallelism {b.tp} must divide the {geo.num_heads} attention heads; "
                f"choose one of {[t for t in range(1, geo.num_heads + 1) if geo.num_heads % t == 0][:8]}."
            )
        if b.pp > geo.num_layers:
            raise ValueError(f"build.pp: {b.pp} pipeline stages for {geo.num_layers} layers; use pp <= layers.")
        fmt = self.kv_format()
        for which in ("k", "v"):
            side = fmt.side(which)
            if side.dtype == "int4" and geo.head_dim % 2:
                raise ValueError(f"kv.{which}_dtype: int4 packs two values per byte and needs an even head_dim "
                                 f"({geo.head_dim}).")
            if side.group_size and geo.head_dim % side.group_size:
                raise ValueError(f"kv.{which}_group_size: {side.group_size} does not divide the model's head_dim "
                                 f"{geo.head_dim}; choose a divisor of it.")
        if b.max_seq_len > geo.max_position_embeddings:
            raise ValueError(
                f"build.max_seq_len ({b.max_seq_len}) exceeds the model's {geo.max_position_embeddings} positions."
            )

    def geometry(self) -> ModelConfig | None:
        """The model's shape without reading weights, when the recipe names a preset."""
        return PRESETS[self.model.preset] if self.model.preset in PRESETS else None

    def kv_format(self) -> KVFormat:
        return self.kv.to_format()


def _check_trtllm_kv(fmt: KVFormat) -> None:
    """What TensorRT-LLM's engine path cannot store, with what it can (trtllm.md §1.1-1.3)."""
    supported = "fp16, bf16, int8 per_tensor, fp8_e4m3 per_tensor"
    if fmt.split:
        raise ValueError(
            f"kv: TensorRT-LLM stores K and V in one KV cache dtype, so {fmt.name} (K {fmt.k.dtype}, "
            f"V {fmt.v.dtype}) has no TensorRT-LLM form; it supports {supported}. Use backend: torch for "
            "separate K and V formats, or one kv.dtype for both."
        )
    if fmt.group_size:
        raise ValueError(
            f"kv.group_size: TensorRT-LLM keeps one KV scale per layer, not group scales; it supports {supported}. "
            "Use backend: torch for group scales, or group_size: 0."
        )
