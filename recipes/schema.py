"""The recipe schema: one validated object per `--recipe NAME`.

Every section forbids unknown keys, so a typo is an error rather than a
silently ignored option (the failure mode of flag-soup build scripts).
Cross-field rules live in `Recipe._check` and say what to change.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from runtime.config import PRESETS, ModelConfig
from runtime.errors import KvqError, UnsupportedError
from runtime.kv_format import PER_CHANNEL_TOKENS, KVFormat
from runtime.parallel.sharding import check_parallelism

from .kv_section import KVSection, SearchSection, Section, parse_layer_format, parse_layer_ranges

# TensorRT-LLM's engine path stores one per-tensor scale per layer and knows only
# INT8 and FP8 (e4m3) KV besides the unquantized baseline (trtllm.md §1.1-1.3).
TRTLLM_KV_DTYPES = ("fp16", "bf16", "int8", "fp8_e4m3")


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
    tp: int = Field(1, ge=1, description="Tensor-parallel ranks (GPUs): TensorRT-LLM's mapping, or the embedded "
                    "engine's process group (runtime/parallel/).")
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
    search: SearchSection = Field(default_factory=SearchSection)

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
        self._check_per_layer()
        try:
            if not kv.per_layer:
                kv.to_format()
        except UnsupportedError as e:
            raise ValueError(f"kv: {e}") from None
        self._check_per_channel_keys()
        if self.backend == "tensorrt-llm" and kv.per_layer:
            raise ValueError(
                "kv.dtype: TensorRT-LLM stores every layer's KV in one format (one kv_cache_quant_algo per "
                "engine), so per-layer formats (kv.dtype: auto, kv.layers) need backend: torch; or give one "
                "format for all layers: kv.dtype fp8_e4m3 / int8 with granularity per_tensor, or fp16 / bf16."
            )
        if self.backend == "tensorrt-llm":
            if kv.rotation != "none":
                raise ValueError(
                    "kv.rotation: TensorRT-LLM's attention has no KV rotation (it would need rotated queries "
                    "and folded projections inside its engine); use kv.rotation: none with TensorRT-LLM, or "
                    "backend: torch for hadamard."
                )
            fmt = kv.to_format()
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
        if self.backend == "torch" and b.pp > 1:
            raise ValueError("build.pp: the embedded torch engine has no pipeline parallelism; set pp: 1 and "
                             "spread the model with build.tp (or use backend: tensorrt-llm).")
        geo = self.geometry()
        if geo is not None:
            self._check_geometry(geo)
        return self

    def _check_geometry(self, geo: ModelConfig) -> None:
        b = self.build
        even = self.backend == "tensorrt-llm"  # the embedded engine also splits heads unevenly
        if even and geo.num_heads % b.tp:
            raise ValueError(
                f"build.tp: tensor parallelism {b.tp} must divide the {geo.num_heads} attention heads; "
                f"choose one of {[t for t in range(1, geo.num_heads + 1) if geo.num_heads % t == 0][:8]}."
            )
        try:
            check_parallelism(geo, b.tp, even=even)
        except UnsupportedError as e:
            raise ValueError(f"build.tp: {e}") from None
        if b.pp > geo.num_layers:
            raise ValueError(f"build.pp: {b.pp} pipeline stages for {geo.num_layers} layers; use pp <= layers.")
        if self.kv.layers is not None:
            parse_layer_ranges(self.kv.layers, geo.num_layers)
        if self.kv.rotation != "none" and geo.head_dim & (geo.head_dim - 1):
            raise ValueError(f"kv.rotation: hadamard needs a power-of-two head_dim, this model has {geo.head_dim}; "
                             "use kv.rotation: none.")
        for fmt in ([] if self.kv.per_layer else [self.kv_format()]):
            for which in ("k", "v"):
                side = fmt.side(which)
                if side.dtype == "int4" and geo.head_dim % 2:
                    raise ValueError(f"kv.{which}_dtype: int4 packs two values per byte and needs an even head_dim "
                                     f"({geo.head_dim}).")
                if side.group_size and geo.head_dim % side.group_size:
                    raise ValueError(f"kv.{which}_group_size: {side.group_size} does not divide the model's "
                                     f"head_dim {geo.head_dim}; choose a divisor of it.")
        if b.max_seq_len > geo.max_position_embeddings:
            raise ValueError(
                f"build.max_seq_len ({b.max_seq_len}) exceeds the model's {geo.max_position_embeddings} positions."
            )

    def geometry(self) -> ModelConfig | None:
        """The model's shape without reading weights, when the recipe names a preset."""
        return PRESETS[self.model.preset] if self.model.preset in PRESETS else None

    def kv_format(self) -> KVFormat:
        return self.kv.to_format()

    def kv_label(self) -> str:
        """The KV format's name, or how the per-layer formats are chosen."""
        if self.kv.dtype == "auto":
            goal = (f"<= {self.kv.target_bits_per_element:g} bits/element" if self.kv.target_bits_per_element
                    else f"ppl <= +{self.accuracy.max_perplexity_increase_pct:g}%")
            return f"auto per layer ({goal})"
        return "per layer (kv.layers)" if self.kv.layers is not None else self.kv.to_format().name

    def formats_needing_calibration(self) -> list[KVFormat]:
        """The static (calibrated-scale) formats this recipe may store: its format, or per-layer candidates."""
        return [f for f in self.stored_formats() if f.static]

    def layer_formats(self, num_layers: int) -> tuple[KVFormat, ...]:
        """One format per layer for a recipe that fixes them (kv.dtype auto: the search stage's output)."""
        if self.kv.dtype == "auto":
            raise UnsupportedError("kv.dtype auto: the search stage chooses the per-layer formats.")
        if self.kv.layers is not None:
            return parse_layer_ranges(self.kv.layers, num_layers)
        return (self.kv.to_format(),) * num_layers

    def stored_formats(self) -> list[KVFormat]:
        """Every format this recipe may store: its format, its kv.layers' formats or its search candidates."""
        kv = self.kv
        if kv.dtype == "auto":
            return self.search.candidates()
        if kv.layers is not None:
            return sorted({parse_layer_format(rng, name) for rng, name in kv.layers.items()}, key=lambda f: f.name)
        return [kv.to_format()]

    def _check_per_channel_keys(self) -> None:
        """Per-channel keys scale over one page of PER_CHANNEL_TOKENS positions and run in one process: refused
        here rather than after the stages before build have run (kv.layers and search candidates included)."""
        b = self.build
        name = next((f.name for f in self.stored_formats() if f.per_channel_keys), None)
        if name is None:
            return
        where = "search.formats lists" if self.kv.dtype == "auto" else "kv stores"
        if b.block_size != PER_CHANNEL_TOKENS:
            raise ValueError(f"build.block_size: {where} {name}, which scales each key channel over one block of "
                             f"{PER_CHANNEL_TOKENS} positions; set build.block_size: {PER_CHANNEL_TOKENS} "
                             f"(got {b.block_size}).")
        if b.tp > 1 and self.backend == "torch":
            raise ValueError(f"build.tp: {where} {name}, whose keys' fp16 residual blocks are kept by one process; "
                             "set build.tp: 1 or leave that format out.")

    def _check_per_layer(self) -> None:
        kv = self.kv
        if kv.dtype == "auto" and kv.layers is not None:
            raise ValueError("kv.layers: a recipe either lists its per-layer formats or lets the search choose them "
                             "(kv.dtype: auto), not both; remove one.")
        if kv.target_bits_per_element is not None and kv.dtype != "auto":
            raise ValueError("kv.target_bits_per_element applies to kv.dtype: auto only; set kv.dtype: auto or "
                             "remove it.")
        if kv.dtype == "auto":
            try:
                cands = self.search.candidates()
            except KvqError as e:
                raise ValueError(f"search.formats: {e}") from None
            if len(set(cands)) != len(cands):
                raise ValueError(f"search.formats: {self.search.formats} names a format twice; list each once.")


def _check_trtllm_kv(fmt: KVFormat) -> None:
    """What TensorRT-LLM's engine path cannot store, with what it can (trtllm.md §1.1-1.3)."""
    supported = "fp16, bf16, int8 per_tensor, fp8_e4m3 per_tensor"
    if fmt.per_channel_keys:
        raise ValueError(
            f"kv: TensorRT-LLM has no INT4 KV cache and no per-channel key scales, so {fmt.name} has no TensorRT-LLM "
            f"form; it supports {supported}. Use backend: torch for {fmt.name}, or kv.format: fp8_e4m3-per_tensor / "
            "int8-per_tensor with TensorRT-LLM."
        )
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
