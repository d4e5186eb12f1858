"""Render Triton `config.pbtxt` files from typed values, and validate them.

TensorRT-LLM's backend fills its templates with `string.Template.safe_substitute`,
so a forgotten key silently stays `${...}` and becomes a server default (or a
parse failure at load time). Here a config is built as Triton's own ModelConfig
protobuf message from typed specs, printed with protobuf's text format, and the
text is parsed back before anything is written: a leftover `${`, an unknown
field or a missing required field fails the deploy, not the server start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from runtime.errors import StageError

# Triton data types by the short names used in the TensorRT-LLM docs.
DTYPES = {
    "BOOL": mc.TYPE_BOOL,
    "UINT8": mc.TYPE_UINT8,
    "INT32": mc.TYPE_INT32,
    "INT64": mc.TYPE_INT64,
    "UINT64": mc.TYPE_UINT64,
    "FP16": mc.TYPE_FP16,
    "FP32": mc.TYPE_FP32,
    "BF16": mc.TYPE_BF16,
    "STRING": mc.TYPE_STRING,
}
INSTANCE_KINDS = {
    "KIND_CPU": mc.ModelInstanceGroup.KIND_CPU,
    "KIND_GPU": mc.ModelInstanceGroup.KIND_GPU,
    "KIND_MODEL": mc.ModelInstanceGroup.KIND_MODEL,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    dims: tuple[int, ...]
    optional: bool = False
    allow_ragged_batch: bool = False


@dataclass(frozen=True)
class EnsembleStep:
    model_name: str
    input_map: dict[str, str]  # model input name -> ensemble tensor name
    output_map: dict[str, str]  # model output name -> ensemble tensor name


@dataclass(frozen=True)
class ModelSpec:
    name: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    backend: str | None = None
    platform: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    decoupled: bool | None = None
    instance_count: int | None = None
    instance_kind: str = "KIND_CPU"
    gpus: tuple[int, ...] = ()
    max_queue_delay_us: int | None = None  # set -> dynamic batching
    preferred_batch_sizes: tuple[int, ...] = ()
    max_queue_size: int | None = None
    steps: tuple[EnsembleStep, ...] = ()


def _tensor(msg, spec: TensorSpec, is_input: bool) -> None:
    if spec.dtype not in DTYPES:
        raise StageError(
            f"tensor {spec.name!r}: unknown data type {spec.dtype!r}; use one of {sorted(DTYPES)}."
        )
    msg.name = spec.name
    msg.data_type = DTYPES[spec.dtype]
    msg.dims.extend(spec.dims)
    if is_input:
        msg.optional = spec.optional
        msg.allow_ragged_batch = spec.allow_ragged_batch


def to_proto(spec: ModelSpec) -> mc.ModelConfig:
    cfg = mc.ModelConfig(name=spec.name, max_batch_size=spec.max_batch_size)
    if spec.backend:
        cfg.backend = spec.backend
    if spec.platform:
        cfg.platform = spec.platform
    for t in spec.inputs:
        _tensor(cfg.input.add(), t, is_input=True)
    for t in spec.outputs:
        _tensor(cfg.output.add(), t, is_input=False)
    for key, value in spec.parameters.items():
        cfg.parameters[key].string_value = str(value)
    if spec.decoupled is not None:
        cfg.model_transaction_policy.decoupled = spec.decoupled
    if spec.instance_count is not None:
        group = cfg.instance_group.add(count=spec.instance_count, kind=INSTANCE_KINDS[spec.instance_kind])
        group.gpus.extend(spec.gpus)
    if spec.max_queue_delay_us is not None:
        cfg.dynamic_batching.max_queue_delay_microseconds = spec.max_queue_delay_us
        cfg.dynamic_batching.preferred_batch_size.extend(spec.preferred_batch_sizes)
        if spec.max_queue_size is not None:
            cfg.dynamic_batching.default_queue_policy.max_queue_size = spec.max_queue_size
    for step in spec.steps:
        s = cfg.ensemble_scheduling.step.add(model_name=step.model_name, model_version=-1)
        s.input_map.update(step.input_map)
        s.output_map.update(step.output_map)
    return cfg


def render(spec: ModelSpec) -> str:
    """The config.pbtxt text for `spec`, already parsed back and validated."""
    text = text_format.MessageToString(to_proto(spec))
    validate_text(text, source=f"{spec.name}/config.pbtxt", expected_name=spec.name)
    return text


def validate_text(
    text: str, source: str = "config.pbtxt", expected_name: str | None = None
) -> mc.ModelConfig:
    """Parse with Triton's ModelConfig schema and check what the server would otherwise default silently."""
    if "${" in text:
        line = next(ln for ln in text.splitlines() if "${" in ln)
        raise StageError(
            f"{source}: unfilled template placeholder in {line.strip()!r}; every value must be set."
        )
    try:
        cfg = text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as e:
        raise StageError(f"{source}: not a valid Triton ModelConfig: {e}") from e
    problems = []
    if not cfg.name:
        problems.append("missing `name`")
    if expected_name is not None and cfg.name != expected_name:
        problems.append(f"name {cfg.name!r} does not match its directory {expected_name!r}")
    if bool(cfg.backend) == bool(cfg.platform):
        problems.append("exactly one of `backend` and `platform` must be set")
    if cfg.max_batch_size < 0:
        problems.append("`max_batch_size` is negative")
    if not cfg.input or not cfg.output:
        problems.append("a model needs at least one input and one output")
    for t in list(cfg.input) + list(cfg.output):
        if not t.name or t.data_type == mc.TYPE_INVALID or not t.dims:
            problems.append(f"tensor {t.name!r} needs a name, a data_type and dims")
    for key, value in cfg.parameters.items():
        if not value.string_value:
            problems.append(f"parameter {key!r} is empty")
    if cfg.platform == "ensemble":
        problems += _ensemble_problems(cfg)
    if problems:
        raise StageError(f"{source}: " + "; ".join(problems) + ".")
    return cfg


def _ensemble_problems(cfg: mc.ModelConfig) -> list[str]:
    steps = cfg.ensemble_scheduling.step
    if not steps:
        return ["an ensemble needs ensemble_scheduling steps"]
    problems = []
    consumed = {v for s in steps for v in s.input_map.values()}
    produced = {v for s in steps for v in s.output_map.values()}
    problems += [f"ensemble input {t.name!r} feeds no step" for t in cfg.input if t.name not in consumed]
    problems += [
        f"ensemble output {t.name!r} is produced by no step" for t in cfg.output if t.name not in produced
    ]
    available = {t.name for t in cfg.input} | produced
    problems += [f"step tensor {v!r} comes from nowhere" for v in consumed if v not in available]
    return problems


def load(path: str | Path) -> mc.ModelConfig:
    path = Path(path)
    return validate_text(path.read_text(), source=str(path), expected_name=path.parent.name)


def validate_repository(repo: str | Path) -> dict[str, mc.ModelConfig]:
    """Every model's config parses, and every ensemble step names a model and tensors that exist."""
    repo = Path(repo)
    configs = {p.parent.name: load(p) for p in sorted(repo.glob("*/config.pbtxt"))}
    if not configs:
        raise StageError(
            f"{repo}: no <model>/config.pbtxt found; write one with `kvq deploy ENGINE --out DIR`."
        )
    for name, cfg in configs.items():
        for step in cfg.ensemble_scheduling.step:
            target = configs.get(step.model_name)
            if target is None:
                raise StageError(f"{name}: step model {step.model_name!r} is not in {repo}.")
            ins = {t.name: t for t in target.input}
            outs = {t.name for t in target.output}
            missing = [k for k in step.input_map if k not in ins] + [
                k for k in step.output_map if k not in outs
            ]
            required = [k for k, t in ins.items() if not t.optional and k not in step.input_map]
            if missing or required:
                raise StageError(
                    f"{name}: step {step.model_name!r} maps unknown tensors {missing} "
                    f"or leaves required inputs {required} unmapped."
                )
    return configs
