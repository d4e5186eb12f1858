"""The recipe's KV sections: `kv` (how K and V are stored, per layer if need be) and `search` (what the
search stage measures for kv.dtype auto), and the kv.layers range syntax. Part of the recipe schema
(recipes/schema.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from runtime.engine_dir import parse_kv_format_name
from runtime.errors import KvqError, UnsupportedError
from runtime.kv_format import GRANULARITIES, GROUP_SIZES, KV_DTYPES, SCALE_DTYPES, KVFormat, format_from_name
from runtime.layer_formats import layer_runs
from runtime.rotation import ROTATIONS, KVRotation

KVDtype = Literal[KV_DTYPES]  # type: ignore[valid-type]
Granularity = Literal[GRANULARITIES]  # type: ignore[valid-type]
ScaleDtype = Literal[SCALE_DTYPES]  # type: ignore[valid-type]
Rotation = Literal[ROTATIONS]  # type: ignore[valid-type]
GroupSize = Literal[GROUP_SIZES]  # type: ignore[valid-type]

# kv.dtype auto: the unquantized baseline, 8-bit, and 4-bit formats that need no calibration, plus 8-bit
# static ones (benchmarks/results/accuracy_smollm2.md: int8 per_head is the most accurate 8-bit format).
DEFAULT_SEARCH_FORMATS = ("fp16", "int8-per_head", "int8-per_token", "fp8_e4m3-per_tensor", "int4-per_token-asym")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# the fields kv.format replaces (a format name says all of them)
FORMAT_FIELDS = frozenset({"dtype", "granularity", "symmetric", "scale_dtype", "group_size", "k_dtype", "v_dtype",
                           "k_symmetric", "v_symmetric", "k_group_size", "v_group_size", "k_granularity"})


class KVSection(Section):
    """How K and V are stored. dtype / symmetric / group_size apply to both unless k_* / v_* give one of
    them its own (e.g. k_dtype: int8, v_dtype: int4, v_symmetric: false: "K8V4"); or `format` names a
    whole format (KVFormat.name, e.g. k.int8-per_token+v.int4-per_token-asym) instead of the fields."""

    format: str | None = Field(None, description="A KV format name (docs/kv-formats.md), instead of the fields.")
    dtype: KVDtype | Literal["auto"] = Field(
        "fp16", description="The KV dtype of every layer, or 'auto': the search stage picks a format per layer "
        "from search.formats, the smallest cache within accuracy.max_perplexity_increase_pct, or the most "
        "accurate one within kv.target_bits_per_element (docs/layer-precision.md).")
    granularity: Granularity = "per_tensor"
    symmetric: bool = True
    scale_dtype: ScaleDtype = "float16"
    group_size: GroupSize = Field(0, description="per_token: one scale (and zero) per group of this many "
                                  "channels of a head; 0: one per token-head.")
    k_granularity: Granularity | None = Field(
        None, description="K's own granularity: per_channel (KIVI: int4 asym keys with a scale and zero per channel "
        "over each 64-token block; build.block_size 64), V keeping `granularity` (per_token).")
    k_dtype: KVDtype | None = None
    v_dtype: KVDtype | None = None
    k_symmetric: bool | None = None
    v_symmetric: bool | None = None
    k_group_size: GroupSize | None = None
    v_group_size: GroupSize | None = None
    clamp_fp8_scales_to_one: bool = Field(
        False, description="Reproduce ModelOpt's TensorRT-LLM export, which clamps FP8 KV scales to >= 1.0."
    )
    target_bits_per_element: float | None = Field(
        None, gt=0, le=32, description="kv.dtype auto: the most accurate per-layer choice whose average bits per "
        "K/V element (scale metadata included) is at most this; unset: the smallest within the accuracy budget.")
    layers: dict[str, str] | None = Field(
        None, description="A KV format per layer, by layer range: {'0-1': 'int8-per_token', '2-29': "
        "'int4-per_token-asym'} (every layer once; format names as `kvq plan` prints them). The search stage "
        "writes this mapping for the formats it chose (search/recipe_kv.yaml), so a choice can be pinned.")
    rotation: Rotation = Field(
        "none", description="hadamard: K (with q, after RoPE) and V rotated by a normalized Walsh-Hadamard "
        "transform over head_dim before they are stored (docs/kv-rotation.md); exact without quantization, "
        "spreads outlier channels before it. Valid for every format of the torch backend.")
    rotation_seed: int | None = Field(
        0, ge=0, description="Seed of the rotation's random sign vector (recorded in the engine's "
        "kv_format.json); null: the plain Walsh-Hadamard matrix.")

    @model_validator(mode="after")
    def _one_spelling(self) -> "KVSection":
        fields = self.model_fields_set & FORMAT_FIELDS
        if self.format is not None and fields:
            raise ValueError(f"kv.format names the whole format; drop kv.{', kv.'.join(sorted(fields))} "
                             "or kv.format.")
        return self

    def to_format(self) -> KVFormat:
        if self.per_layer:
            raise UnsupportedError("this recipe gives the KV format per layer (kv.dtype: auto or kv.layers); "
                                   "use Recipe.layer_formats() for it.")
        if self.format is not None:
            return format_from_name(self.format)

        def pick(own, shared):
            return shared if own is None else own

        return KVFormat(
            pick(self.k_dtype, self.dtype), pick(self.k_granularity, self.granularity),
            pick(self.k_symmetric, self.symmetric), self.scale_dtype, pick(self.k_group_size, self.group_size),
            pick(self.v_dtype, self.dtype), pick(self.v_symmetric, self.symmetric),
            pick(self.v_group_size, self.group_size), self.granularity if self.k_granularity else None,
        )

    @property
    def per_layer(self) -> bool:
        """The formats differ per layer: chosen by the search stage (auto) or listed in kv.layers."""
        return self.dtype == "auto" or self.layers is not None

    def kv_rotation(self) -> KVRotation:
        return KVRotation(self.rotation, self.rotation_seed)


class SearchSection(Section):
    """kv.dtype auto: what the search stage measures (docs/layer-precision.md)."""

    formats: list[str] = Field(
        default_factory=lambda: list(DEFAULT_SEARCH_FORMATS), min_length=2,
        description="The formats a layer may get (names as `kvq plan` prints them); the one with the most bytes "
        "is where every layer starts. Static formats (per_tensor/per_head) use the calibrate stage's scales.")
    num_samples: int = Field(8, ge=1, description="Calibration-data windows each sensitivity is measured on.")
    seq_len: int = Field(512, ge=16, description="Tokens per window.")
    validation_samples: int = Field(4, ge=0, description="Further calibration-data windows (not the "
                                    "sensitivities') every uniform candidate and every descent step is checked "
                                    "on; 0: the sensitivities' windows.")
    margin: float = Field(0.75, gt=0, le=1, description="The fraction of accuracy.max_perplexity_increase_pct "
                          "the choice must meet on the check windows: room for the held-out text to differ.")

    def candidates(self) -> list[KVFormat]:
        return [parse_kv_format_name(n) for n in self.formats]


def parse_layer_format(rng: str, name: str, where: str = "kv.layers") -> KVFormat:
    """The format a kv.layers entry names, or a ValueError naming the entry."""
    try:
        return parse_kv_format_name(name)
    except KvqError as e:
        raise ValueError(f"{where}[{rng!r}]: {e}") from None


def parse_layer_ranges(layers: dict[str, str], num_layers: int, where: str = "kv.layers") -> tuple[KVFormat, ...]:
    """{'0-1': 'int8-per_token', '2': ...} -> one KVFormat per layer; every layer exactly once."""
    out: list[KVFormat | None] = [None] * num_layers
    for rng, name in layers.items():
        try:
            a, _, b = str(rng).partition("-")
            first, last = int(a), int(b) if b else int(a)
        except ValueError:
            raise ValueError(f"{where}: {rng!r} is not a layer range; write 'FIRST-LAST' or 'LAYER', e.g. '0-1'.") from None
        if not 0 <= first <= last < num_layers:
            raise ValueError(f"{where}: range {rng!r} is outside the model's layers 0-{num_layers - 1}.")
        fmt = parse_layer_format(rng, name, where)
        for i in range(first, last + 1):
            if out[i] is not None:
                raise ValueError(f"{where}: layer {i} is given twice ({rng!r}); give every layer once.")
            out[i] = fmt
    missing = [i for i, f in enumerate(out) if f is None]
    if missing:
        raise ValueError(f"{where}: layers {missing[:8]} have no format; give every layer of 0-{num_layers - 1} once.")
    return tuple(out)  # type: ignore[arg-type]


def layer_ranges(formats: tuple[KVFormat, ...]) -> dict[str, str]:
    """The inverse of parse_layer_ranges: consecutive layers of one format as one range."""
    return {(f"{a}-{b}" if b > a else f"{a}"): f.name for a, b, f in layer_runs(formats)}
