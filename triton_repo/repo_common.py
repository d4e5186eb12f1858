"""The parts of a model repository that torch and TensorRT-LLM engines share.

Both repositories have TensorRT-LLM's `inflight_batcher_llm` shape:
preprocessing -> engine model -> postprocessing, joined by an `ensemble`
whose request fields are TensorRT-LLM's (text_input, max_tokens, ... ->
text_output), so a client written for one serves the other.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from runtime.errors import InputError, StageError
from runtime.tokenizer import TOKENIZER_JSON

from . import protocol
from .pbtxt import EnsembleStep, ModelSpec, TensorSpec, render, validate_repository

MODELS_SOURCE = Path(__file__).parent / "models"

# The fields a tensorrt_llm model written by repo_trtllm takes (its ensemble offers only these).
TRTLLM_FIELDS = ("text_input", "max_tokens", "temperature", "top_k", "top_p", "random_seed", "end_id",
                 "stop_words", "stream", "apply_chat_template")


def check_tokenizer_dir(path: Path) -> Path:
    # the serving models load the fast tokenizer from tokenizer.json alone (runtime/tokenizer.py)
    if not (path / TOKENIZER_JSON).is_file():
        raise InputError(
            f"{path} has no {TOKENIZER_JSON}; preprocessing and postprocessing load the tokenizer from it. "
            "Point deploy at the converted model directory (settings tokenizer_dir) or rebuild the engine."
        )
    return path


def preprocessing_spec(
    tokenizer_dir: Path, max_batch_size: int, instance_count: int, max_input_len: int | None = None
) -> ModelSpec:
    """`max_input_len` (when known) bounds text_input in bytes before it is tokenized."""
    inputs = [TensorSpec(f.to, f.dtype, f.dims, optional=f.optional)
              for f in protocol.ENSEMBLE_REQUEST if f.step == "pre"]
    params = {"tokenizer_dir": str(tokenizer_dir)}
    if max_input_len is not None:
        params["max_input_len"] = str(int(max_input_len))
    return ModelSpec(
        name=protocol.PREPROCESSING,
        backend="python",
        max_batch_size=max_batch_size,
        inputs=tuple(inputs),
        outputs=(
            TensorSpec("INPUT_ID", "INT32", (-1,)),
            TensorSpec("REQUEST_INPUT_LEN", "INT32", (1,)),
            TensorSpec("STOP_WORDS_IDS", "INT32", (2, -1)),
            TensorSpec("BAD_WORDS_IDS", "INT32", (2, -1)),
        ),
        parameters=params,
        instance_count=instance_count,
    )


def postprocessing_spec(
    tokenizer_dir: Path, max_batch_size: int, instance_count: int, cumulative: bool
) -> ModelSpec:
    """`cumulative`: the engine model resends all ids with PREV_LENGTH/IS_FINAL (kvq_engine)."""
    inputs = [TensorSpec("TOKENS_BATCH", "INT32", (-1, -1)), TensorSpec("SEQUENCE_LENGTH", "INT32", (-1,))]
    if cumulative:
        inputs += [TensorSpec("PREV_LENGTH", "INT32", (1,)), TensorSpec("IS_FINAL", "BOOL", (1,))]
    return ModelSpec(
        name=protocol.POSTPROCESSING,
        backend="python",
        max_batch_size=max_batch_size,
        inputs=tuple(inputs),
        outputs=(TensorSpec("OUTPUT", "STRING", (-1,)),),
        parameters={"tokenizer_dir": str(tokenizer_dir)},
        instance_count=instance_count,
    )


def ensemble_spec(
    engine_model: str,
    max_batch_size: int,
    streaming: bool,
    cumulative: bool,
    engine: ModelSpec | None = None,
    name: str = protocol.ENSEMBLE,
    fields: tuple[protocol.Field, ...] = protocol.ENSEMBLE_REQUEST,
) -> ModelSpec:
    """The ensemble over preprocessing -> `engine_model` -> postprocessing.

    `engine` (the engine model's spec) decides which request fields and pass-through outputs the
    ensemble offers: every field whose step input it has. Without it, the TensorRT-LLM field set.
    """
    if engine is None:
        fields = tuple(f for f in fields if f.name in TRTLLM_FIELDS)
        engine_ins, engine_outs = None, set()
    else:
        engine_ins = {t.name for t in engine.inputs}
        engine_outs = {t.name for t in engine.outputs}
    fields = tuple(
        f for f in fields
        if (streaming or f.name != "stream") and (f.step == "pre" or engine_ins is None or f.to in engine_ins)
    )
    pre_in = {f.to: f.name for f in fields if f.step == "pre"}
    pre_out = {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
               "STOP_WORDS_IDS": "_STOP_WORDS_IDS"}
    engine_in = {f.to: f.name for f in fields if f.step == "engine"}
    engine_in.update(
        {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN", "stop_words_list": "_STOP_WORDS_IDS"}
    )
    if engine_ins is not None and "bad_words_list" in engine_ins:
        pre_out["BAD_WORDS_IDS"] = "_BAD_WORDS_IDS"
        engine_in["bad_words_list"] = "_BAD_WORDS_IDS"
    passed = [o for o in protocol.ENSEMBLE_OUTPUTS if o[0] in engine_outs]
    engine_out = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH"}
    engine_out.update({o[0]: o[0] for o in passed})
    post_in = {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"}
    if cumulative:
        engine_out.update({"prev_length": "_PREV_LENGTH", "is_final": "_IS_FINAL"})
        post_in.update({"PREV_LENGTH": "_PREV_LENGTH", "IS_FINAL": "_IS_FINAL"})
    return ModelSpec(
        name=name,
        platform="ensemble",
        max_batch_size=max_batch_size,
        inputs=tuple(TensorSpec(f.name, f.dtype, f.dims, optional=f.optional) for f in fields),
        outputs=(TensorSpec("text_output", "STRING", (-1,)),) + tuple(TensorSpec(*o) for o in passed),
        steps=(
            EnsembleStep(protocol.PREPROCESSING, pre_in, pre_out),
            EnsembleStep(engine_model, engine_in, engine_out),
            EnsembleStep(protocol.POSTPROCESSING, post_in, {"OUTPUT": "text_output"}),
        ),
    )


def write_models(out_dir: Path, specs: list[tuple[ModelSpec, str | None]]) -> list[str]:
    """Write <model>/config.pbtxt (+ 1/model.py copied from triton_repo/models/<source>.py).

    Every config is rendered and validated before the first file is written, and the
    repository as a whole (ensemble wiring) is validated after; returns the files written.
    """
    texts = [(spec, render(spec), source) for spec, source in specs]
    files = []
    for spec, text, source in texts:
        model_dir = out_dir / spec.name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "config.pbtxt").write_text(text)
        files.append(f"{spec.name}/config.pbtxt")
        if source is not None:
            shutil.copy2(MODELS_SOURCE / f"{source}.py", model_dir / "1" / "model.py")
            files.append(f"{spec.name}/1/model.py")
    validate_repository(out_dir)
    return files


def require_empty(out_dir: Path) -> Path:
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise StageError(f"deploy output {out_dir} must be an existing (empty) directory.")
    if any(out_dir.iterdir()):
        raise StageError(
            f"deploy output {out_dir} is not empty; deploy writes into a fresh temporary directory."
        )
    return out_dir
