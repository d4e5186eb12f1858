"""The `evaluate` stage: every engine's KV format against the same model with unquantized KV.

Metrics (see perplexity.py, passkey.py, accuracy.py): perplexity on held-out
text and its relative change, teacher-forced greedy-token agreement, top-1
agreement at every scored position of the held-out text, passkey
retrieval rate and mean digit log-probability per context length, per-layer
attention-output relative error. All engines of a model share its weights, so
the model is loaded once and each engine contributes only its KV format and
scales. Results: `accuracy.json` and `accuracy.md` (a readable table), plus
budget violations when a budget is given.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

import torch

from runtime.config import ModelConfig
from runtime.engine_dir import resolve_layer_formats, resolve_rotation, resolve_scales
from runtime.errors import InputError
from runtime.kv_format import KVFormat
from runtime.layer_formats import formats_name, formats_to_json, uniform_format
from runtime.rotation import NO_ROTATION, KVRotation

from . import corpus
from .accuracy import (
    PROMPTS,
    baseline_layer_inputs,
    chat_prompt_ids,
    engine_attention_error,
    greedy_agreement,
    top1_agreement,
)
from .budget import check_budget
from .engine_check import (
    baseline_format,
    engine_greedy,
    evaluation_engine,
    greedy_continuations,
)
from .files import write_json_atomic, write_text_atomic
from .loading import load_model, load_tokenizer
from .passkey import make_trials, passkey
from .perplexity import eval_windows, perplexity, scored_perplexity
from .progress import work_progress
from .report import markdown_table

PATH_NAME = "engine"
PATH_NOTE = ("teacher-forced scoring through runtime.engine.Engine (Engine.score: prefill passes through the paged "
             "pool with quantize-on-write, the engine's attention backend and chunking); per-layer attention error "
             "reads K/V back from the engine's pool with its decode op; engine greedy = free-running generation.")


@dataclass
class EvalSettings:
    """Names match recipes.schema.AccuracySection; defaults are CI-sized."""

    perplexity_tokens: int = 1024
    perplexity_window: int = 1024
    greedy_prompts: int = 4
    greedy_tokens: int = 32
    passkey_lengths: list[int] = field(default_factory=lambda: [256, 1024])
    passkey_trials: int = 20
    attention_tokens: int = 256
    engine_greedy: bool = True  # also free-running generation through each engine (engine_check.py)
    batch_invariant: bool = True  # the engines' batch-invariant mode (runtime/batch_invariant.py)
    attention: str = "auto"  # the engines' attention backend: auto (kernels on CUDA) or reference
    eval_data: str = corpus.BUILTIN  # held-out text: 'builtin' or the user's .txt/.jsonl file or directory
    # more texts scored for perplexity alone (e.g. another domain than the calibration data's), by path
    extra_eval_data: list[str] = field(default_factory=list)
    seed: int = 0

    @classmethod
    def from_any(cls, src: Any = None) -> "EvalSettings":
        """From an AccuracySection (or dict): fields with our names are taken, others ignored."""
        if src is None:
            return cls()
        get = src.get if isinstance(src, Mapping) else lambda k, d=None: getattr(src, k, d)
        kw = {f.name: get(f.name) for f in fields(cls) if get(f.name) is not None}
        return cls(**kw)


@dataclass
class EngineKV:
    name: str
    fmt: KVFormat | tuple[KVFormat, ...]  # one format, or one per layer (runtime/layer_formats.py)
    k_scale: torch.Tensor | list | None = None  # [layers(, kv_heads)], or one entry per layer
    v_scale: torch.Tensor | list | None = None
    note: str = ""
    rotation: KVRotation = NO_ROTATION  # K/V rotated before they are stored (runtime/rotation.py)

    @property
    def formats(self) -> tuple[KVFormat, ...]:
        return (self.fmt,) if isinstance(self.fmt, KVFormat) else tuple(self.fmt)

    @property
    def quantized(self) -> bool:
        return any(f.quantized for f in self.formats)

    def describe(self) -> dict:
        """What accuracy.json records as the engine's kv_format."""
        return asdict(self.fmt) if isinstance(self.fmt, KVFormat) else formats_to_json(self.fmt)


def engine_kv_from_dir(path: str | Path, name: str | None = None) -> EngineKV:
    """An engine directory's KV format(s) (kv_format.json) and static scales (kv_scales.safetensors)."""
    d = Path(path)
    if not (d / "kv_format.json").is_file():
        return EngineKV(name or d.name, KVFormat("fp32"), note="no kv_format.json: unquantized KV")
    cfg = ModelConfig.from_dir(d)
    formats = resolve_layer_formats(None, d, torch.float32, cfg.num_layers)
    k, v = resolve_scales(formats, None, d, cfg)
    rot = resolve_rotation(None, d, cfg)
    one = uniform_format(formats)
    if one is None:
        return EngineKV(name or d.name, formats, k, v, note=formats_name(formats), rotation=rot)
    if one.static:
        k, v = torch.stack(k), torch.stack(v)
    return EngineKV(name or d.name, one, k, v, rotation=rot)


def _pct(a: float, b: float) -> float:
    return (a / b - 1.0) * 100.0


def _sequences_tokens(*groups: list[torch.Tensor]) -> int:
    return sum(int(t.numel()) for g in groups for t in g)


def run_evaluation(model_dir: str | Path, engines: list[EngineKV | str | Path], out_dir: str | Path | None = None,
                   settings: Any = None, budget: Any = None, device: str = "cpu",
                   dtype: str | None = None, progress: bool = False, on_engine=None) -> dict:
    """Evaluate `engines` (EngineKV or engine directories) against unquantized KV on `model_dir`, every
    metric through runtime.engine.Engine. progress: per-batch rich progress bars on stderr.
    on_engine(results): called after each engine with the results so far (a long run can save them).

    Writes accuracy.json and accuracy.md into `out_dir` when given. Returns the
    results dict (the same content as accuracy.json).
    """
    s = EvalSettings.from_any(settings)
    specs = [e if isinstance(e, EngineKV) else engine_kv_from_dir(e) for e in engines]
    names = [e.name for e in specs]
    if len(set(names)) != len(names):
        raise InputError(f"engine names must be unique, got {names}.")
    t0 = time.perf_counter()
    cfg = ModelConfig.from_dir(model_dir)
    tok = load_tokenizer(model_dir)
    model = load_model(model_dir, device=device, dtype=dtype)

    windows = eval_windows(tok, s.perplexity_tokens, s.perplexity_window, s.eval_data)
    extra = {str(p): eval_windows(tok, s.perplexity_tokens, s.perplexity_window, str(p),
                                  field="extra_eval_data") for p in s.extra_eval_data}
    prompts = [chat_prompt_ids(tok, p) for p in (PROMPTS * 8)[: s.greedy_prompts]]
    trials = make_trials(tok, s.passkey_lengths, s.passkey_trials, s.seed, cfg.max_position_embeddings)
    flat_trials = [t.ids for ts in trials.values() for t in ts]
    longest = max([windows.shape[1], *(t.numel() for t in flat_trials), *(p.numel() + s.greedy_tokens for p in prompts)])
    scored = _sequences_tokens(list(windows), flat_trials)
    inputs, _ = baseline_layer_inputs(model, windows[0, : s.attention_tokens])

    models = {NO_ROTATION: model}  # one model per KV rotation: the rotation is folded into its weights

    def engine(fmt: KVFormat, k=None, v=None, rotation: KVRotation = NO_ROTATION):
        if rotation not in models:
            models[rotation] = load_model(model_dir, device=device, dtype=dtype, rotation=rotation)
        return evaluation_engine(models[rotation], model_dir, fmt, k, v, longest, batch=max(1, len(prompts)),
                                 batch_invariant=s.batch_invariant, attention=s.attention)

    timing: dict[str, float] = {}
    results: dict[str, Any] = {
        "path": PATH_NAME, "path_note": PATH_NOTE, "model_dir": str(Path(model_dir).resolve()),
        "model_dtype": str(model.dtype).replace("torch.", ""), "device": device, "settings": asdict(s),
        "batch_invariant": s.batch_invariant, "engines": {},
    }
    with work_progress(progress) as bars:
        t = time.perf_counter()
        base = engine(baseline_format(model))
        try:
            base_ppl, base_top1 = scored_perplexity(base, windows, bars.task("baseline perplexity",
                                                                            int(windows.numel())))
            base_extra = {p: perplexity(base, w) for p, w in extra.items()}
            conts = greedy_continuations(base, prompts, s.greedy_tokens)
            base_passkey = passkey(base, trials, bars.task("baseline passkey", _sequences_tokens(flat_trials)))
            results["attention"] = base.stats.attention
        finally:
            base.shutdown()
            del base
        timing["baseline"] = round(time.perf_counter() - t, 2)
        results["baseline"] = {
            "kv": f"unquantized ({str(model.dtype).replace('torch.', '')})", "perplexity": base_ppl,
            "greedy": {"tokens": sum(c.numel() for c in conts)}, "passkey": base_passkey}
        if extra:
            results["baseline"]["perplexity_extra"] = base_extra
        greedy_tokens = _sequences_tokens(prompts, conts)
        for e in specs:
            t = time.perf_counter()
            if not e.quantized:
                results["engines"][e.name] = {"kv_format": e.describe(), "note": e.note or "unquantized KV"}
                continue
            eng = engine(e.fmt, e.k_scale, e.v_scale, e.rotation)
            try:
                advance = bars.task(e.name, scored + greedy_tokens)
                ppl, top1 = scored_perplexity(eng, windows, advance)
                pk = passkey(eng, trials, advance)
                r = {
                    "kv_format": e.describe(), "kv_rotation": e.rotation.name, "note": e.note,
                    "perplexity": {**ppl, "change_pct": _pct(ppl["perplexity"], base_ppl["perplexity"])},
                    "greedy": greedy_agreement(eng, prompts, conts, advance),
                    "top1": top1_agreement(base_top1, top1),
                    "passkey": {**pk, "rate_relative": pk["rate"] / base_passkey["rate"] if base_passkey["rate"]
                                else None},
                    "attention_error": engine_attention_error(eng, inputs),
                }
                if s.engine_greedy:
                    r["engine_greedy"] = engine_greedy(eng, prompts, conts)
                if extra:
                    r["perplexity_extra"] = {}
                    for p, w in extra.items():
                        ppl = perplexity(eng, w)
                        r["perplexity_extra"][p] = {**ppl, "change_pct": _pct(ppl["perplexity"],
                                                                              base_extra[p]["perplexity"])}
            finally:
                eng.shutdown()
                del eng
            results["engines"][e.name] = r
            timing[e.name] = round(time.perf_counter() - t, 2)
            if on_engine is not None:
                on_engine({**results, "timing_s": dict(timing)})
    timing["total"] = round(time.perf_counter() - t0, 2)
    results["timing_s"] = timing
    if budget is not None:
        results["budget"] = {k: getattr(budget, k, None) if not isinstance(budget, Mapping) else budget.get(k)
                             for k in ("max_perplexity_increase_pct", "min_passkey_rate_relative",
                                       "min_greedy_agreement")}
        results["violations"] = [v.to_dict() for v in check_budget(results, budget)]
    if out_dir is not None:
        out = Path(out_dir)
        write_json_atomic(out / "accuracy.json", results)
        write_text_atomic(out / "accuracy.md", markdown_table(results))
    return results
