"""Per-layer KV formats: engine directories, recipes, pool sizing, and the search that chooses them."""

from __future__ import annotations

import json

import pytest
import torch
from helpers_runtime import tiny_llama_dir
from safetensors.torch import save_file

from calibration.budget_search import compose, layer_options, search
from calibration.layer_search import EngineScorer, Sensitivity, choose
from calibration.loading import load_model
from recipes import load_recipe
from recipes.kv_section import layer_ranges, parse_layer_ranges
from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.errors import AccuracyBudgetError, InputError, RecipeError, UnsupportedError
from runtime.kv_format import KVFormat, kv_bytes_per_token
from runtime.layer_formats import formats_name, formats_to_json

INT8_HEAD = KVFormat("int8", "per_head")
INT8_TOK = KVFormat("int8", "per_token")
INT4 = KVFormat("int4", "per_token", symmetric=False)
FP32 = KVFormat("fp32")
MIXED = (INT8_HEAD, INT4, FP32, INT8_TOK)  # 4 layers, one static


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """The tiny Llama with 4 layers, so a choice can mix formats."""
    return tiny_llama_dir(tmp_path_factory, num_hidden_layers=4)


def _engine_dir(src, dst, formats, scales: dict | None = None):
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    (dst / "kv_format.json").write_text(json.dumps(formats_to_json(formats)))
    if scales is not None:
        save_file(scales, str(dst / "kv_scales.safetensors"))
    return dst


# --------------------------------------------------------------- engine dirs
def test_mixed_engine_dir_round_trip_and_pool_matches_planner(tiny4, tmp_path):
    cfg = ModelConfig.from_dir(tiny4)
    d = _engine_dir(tiny4, tmp_path, MIXED)
    with pytest.raises(InputError, match="int8-per_head needs calibrated scales"):
        Engine.from_dir(d)
    save_file({"v_scale.0": torch.full((cfg.num_kv_heads,), 0.05)}, str(d / "kv_scales.safetensors"))
    with pytest.raises(InputError, match=r"'k_scale\.0' is missing"):
        Engine.from_dir(d)
    save_file({"k_scale.0": torch.ones(()), "v_scale.0": torch.ones(())}, str(d / "kv_scales.safetensors"))
    with pytest.raises(InputError, match=r"k_scale\.0 \(layer 0\) has shape \[\], per_head needs \[2\]"):
        Engine.from_dir(d)
    save_file({"k_scale.0": torch.full((cfg.num_kv_heads,), 0.05), "v_scale.0": torch.full((cfg.num_kv_heads,), 0.05)},
              str(d / "kv_scales.safetensors"))
    eng = Engine.from_dir(d, num_blocks=10, block_size=8)
    try:
        assert eng.formats == MIXED
        assert eng.stats.kv_format == formats_name(MIXED) == (
            "L0:int8-per_head,L1:int4-per_token-asym,L2:fp32,L3:int8-per_token")
        with pytest.raises(UnsupportedError, match="engine.formats"):
            _ = eng.fmt
        # Bytes per token by hand, per layer: 2 (K, V) x kv_heads x (stored bytes + per-token scale metadata).
        h, dim = cfg.num_kv_heads, cfg.head_dim
        by_hand = 2 * h * ((dim + 0) + (dim // 2 + 4) + 4 * dim + (dim + 2))
        assert eng.stats.kv_bytes_per_token == by_hand
        assert eng.stats.pool_allocated_bytes == eng.stats.pool_bytes == 10 * 8 * by_hand
        caches = eng.runner.caches
        assert [c.fmt for c in caches] == list(MIXED)
        assert caches[1].k.dtype == torch.uint8 and caches[1].k.shape[-1] == dim // 2
        assert all(c.num_blocks == 10 for c in caches)  # block ids are shared by every layer
        prompts = [[3, 5, 7, 11, 13, 17, 19, 23, 29], [4, 6, 8]]
        batched = [g.token_ids for g in eng.generate(prompts, max_tokens=12, ignore_eos=True)]
        alone = [eng.generate([p], max_tokens=12, ignore_eos=True)[0].token_ids for p in prompts]
        assert batched == alone
    finally:
        eng.shutdown()


def test_each_layer_stores_its_own_format(tiny4, tmp_path):
    """A per-layer engine whose layers all share a format scores exactly like the uniform engine; one layer in
    int4 changes the scores, and not into those of int4 everywhere."""
    windows = [list(range(5, 69)), list(range(100, 164))]

    def nll(sub, formats=None, raw=None):
        (tmp_path / sub).mkdir()
        d = _engine_dir(tiny4, tmp_path / sub, formats or (FP32,) * 4)
        if raw is not None:
            (d / "kv_format.json").write_text(json.dumps(raw))
        eng = Engine.from_dir(d, num_blocks=32, block_size=8)
        try:
            return torch.cat([s.logprobs for s in eng.score(windows)]).double()
        finally:
            eng.shutdown()

    uniform = nll("u", (INT8_TOK,) * 4)
    same = nll("same", raw={"layers": [formats_to_json((INT8_TOK,))] * 4})  # the per-layer layout, one format
    assert torch.equal(same, uniform)
    one4 = nll("one4", (INT8_TOK, INT8_TOK, INT4, INT8_TOK))
    all4 = nll("all4", (INT4,) * 4)
    assert not torch.equal(one4, uniform) and not torch.equal(one4, all4)


def test_bad_per_layer_kv_format_json(tiny4, tmp_path):
    d = _engine_dir(tiny4, tmp_path, MIXED[:3] + (INT8_TOK,))
    (d / "kv_format.json").write_text(json.dumps({"layers": [formats_to_json((INT8_TOK,))] * 3}))
    with pytest.raises(InputError, match="one KV format for each of the model's 4 layers"):
        Engine.from_dir(d)
    (d / "kv_format.json").write_text(json.dumps({"layers": [{"dtype": "int3"}] * 4}))
    with pytest.raises(InputError, match=r"layers\[0\].*int3"):
        Engine.from_dir(d)


# ------------------------------------------------------------------- recipes
def test_per_layer_formats_round_trip_through_recipes():
    formats = (INT8_TOK, INT8_TOK) + (INT4,) * 27 + (INT8_HEAD,)
    ranges = layer_ranges(formats)
    assert ranges == {"0-1": "int8-per_token", "2-28": "int4-per_token-asym", "29": "int8-per_head"}
    r = load_recipe("smollm2-135m-int8kv", [f"kv.layers={json.dumps(ranges)}"])
    assert r.layer_formats(30) == formats == parse_layer_ranges(ranges, 30)
    assert r.kv_label() == "per layer (kv.layers)"
    assert r.formats_needing_calibration() == [INT8_HEAD]


@pytest.mark.parametrize("sets, match", [
    (['kv.layers={"0-1": int8-per_token}'], r"kv.layers: layers \[2, 3"),
    (['kv.layers={"0-29": int8-per_token, "29": int4-per_token-asym}'], "layer 29 is given twice"),
    (['kv.layers={"0-29": int9-per_token}'], "int9"),
    (['kv.layers={"a-b": int8-per_token}'], "not a layer range"),
    (["kv.target_bits_per_element=6"], "applies to kv.dtype: auto only"),
    (["kv.dtype=auto", "search.formats=[int8-per_token, int8-per_token]"], "names a format twice"),
    (["kv.dtype=auto", "search.formats=[int8-per_token, nope]"], "search.formats"),
    (["kv.dtype=auto", "backend=tensorrt-llm"], "TensorRT-LLM stores every layer's KV in one format.*fp8_e4m3"),
])
def test_bad_per_layer_recipes(sets, match):
    with pytest.raises(RecipeError, match=match):
        load_recipe("smollm2-135m-int8kv", sets)


# -------------------------------------------------------------------- choice
def _sens(rows, layer_bytes=(4.0, 2.0, 1.0), offset=0.0) -> Sensitivity:
    return Sensitivity((KVFormat("fp16"), INT8_TOK, INT4), list(layer_bytes), 0.0, offset, [list(r) for r in rows])


def test_choose_takes_the_cheapest_steps_per_byte_first():
    s = _sens([[0, 0.5, 5.0], [0, 0.01, 0.02], [0, 0.1, 0.3]])
    # by hand: layer 1 to int4 costs 0.02, layer 2 to int4 0.3 (0.32 in all); layer 0 to int8 would add 0.5
    assert choose(s, max_nll=0.5) == [0, 2, 2]
    assert choose(s, max_nll=0.83) == [1, 2, 2]
    assert choose(s, max_nll=0.0) == [0, 0, 0]
    # size mode, the same order of steps: 6 bytes = 4 + 1 + 1, 4 bytes = 2 + 1 + 1; 2 bytes cannot be reached
    assert choose(s, max_layer_bytes=6) == [0, 2, 2]
    assert choose(s, max_layer_bytes=4) == [1, 2, 2]
    with pytest.raises(InputError, match="target_bits_per_element"):
        choose(s, max_layer_bytes=2)


def test_choose_skips_dominated_formats_and_counts_noise_as_zero():
    # layer 0: int4 is cheaper than int8 (int8 is dominated); layer 1: negative (noise) measured as free
    s = _sens([[0, 0.3, 0.1], [0, -0.2, -0.1]], offset=0.05)
    assert choose(s, max_nll=0.16) == [2, 2]
    assert s.predicted([2, 2]) == pytest.approx(0.15)
    assert choose(s, max_nll=0.1) == [0, 2]


def test_sensitivity_round_trips_through_json():
    s = _sens([[0, 0.5, 5.0], [0, 0.01, 0.02], [0, 0.1, 0.3]])
    assert Sensitivity.from_dict(s.to_dict(), lambda n: {f.name: f for f in s.candidates}[n]) == s


# ------------------------------------------------------------ budget search
K8V4 = KVFormat("int8", "per_token", v_dtype="int4", v_symmetric=False)
K4V8 = KVFormat("int4", "per_token", symmetric=False, v_dtype="int8", v_symmetric=True)


def test_layer_options_pair_every_k_side_with_every_v_side_below_the_start():
    cfg = _Model.cfg
    # bytes per token-head at head_dim 64, by hand: int8 per_token 64 + 2 (scale), int4 asym 32 + 2 + 2 (scale,
    # zero); a split format is the mean of its sides; fp32 256
    assert layer_options([INT8_TOK, INT4], INT8_TOK, cfg) == (INT8_TOK, K4V8, K8V4, INT4)  # 66; 51 = 51 by name; 36
    assert layer_options([INT8_TOK, INT4, FP32], K8V4, cfg) == (K8V4, INT4)  # K4V8 is as large as the start
    # a static format pairs with nothing (split formats are dynamic on both sides) but is an option itself
    assert layer_options([FP32, INT8_HEAD, INT4], FP32, cfg) == (FP32, INT8_HEAD, INT4)
    assert compose(INT8_HEAD, INT4) is None and compose(INT8_TOK, INT4) == K8V4 and compose(INT4, INT4) == INT4


class _Model:
    dtype = torch.float32

    class cfg:
        num_layers, num_kv_heads, head_dim = 3, 1, 64


class _Scorer:
    """A stand-in for the engine with known answers: the NLL increase of a configuration is the sum of its
    layers' costs, `cost[layer][format name]` (unquantized fp32: 0), times `interaction`."""

    def __init__(self, cost: list[dict[str, float]], interaction: float = 1.0):
        self.cost, self.interaction, self.model, self.passes = cost, interaction, _Model(), 0

    def nll(self, formats) -> float:
        self.passes += 1
        return self.interaction * sum(c.get(f.name, 0.0) for c, f in zip(self.cost, formats))


def _costs(int8, k8v4, k4v8, int4):
    return [{INT8_TOK.name: a, K8V4.name: b, K4V8.name: c, INT4.name: d} for a, b, c, d in zip(int8, k8v4, k4v8, int4)]


GOAL = float(torch.log1p(torch.tensor(0.01)))  # +1% as NLL


def test_search_starts_from_the_smallest_uniform_that_fits_and_descends_verified():
    # layer 0 is sensitive to 4-bit keys, layers 1-2 to nothing. By hand: uniform int8 costs 0.003 <= 0.75 x GOAL
    # = 0.00746, uniform int4 0.052: the start is int8. Relative to it, layers 1-2 in int4 are free and layer 0
    # in K8V4 costs 0.003: one batch, measured 0.004 + 0.001 + 0.001 = 0.006, fits; layer 0 in int4 would add
    # 0.046: undone, and no step is left
    cost = _costs([0.001, 0.001, 0.001], [0.004, 0.002, 0.002], [0.05, 0.002, 0.002], [0.05, 0.001, 0.001])
    found = search(_Scorer(cost), [INT4, INT8_TOK], max_pct=1.0, validator=_Scorer(cost), margin=0.75)
    assert found.start == INT8_TOK
    assert found.formats == (K8V4, INT4, INT4)
    assert [(c.label, c.kept) for c in found.checks if c.kind == "uniform"] == [
        ("uniform int8-per_token", True), ("uniform int4-per_token-asym", False)]
    steps = [c for c in found.checks if c.kind == "descent"]
    assert [(c.formats, c.kept) for c in steps] == [((K8V4, INT4, INT4), True), ((INT4, INT4, INT4), False)]
    assert steps[0].measured_nll == pytest.approx(0.006)
    assert all(c.data == "validation" for c in found.checks)


def test_search_undoes_a_batch_that_breaks_the_budget():
    # the sensitivity windows see every layer's int4 as 0.0001; the check windows see 40x that. By hand: the
    # batch of all three (0.012 > 0.00746) is undone; layer 0 alone (0.004) stays; layers 1-2 (0.012) are
    # undone, then each alone (0.008): each layer 1 and 2 stays int8
    cost = _costs([0.0] * 3, [0.00005] * 3, [0.0001] * 3, [0.0001] * 3)
    found = search(_Scorer(cost), [INT4, INT8_TOK], max_pct=1.0, validator=_Scorer(cost, 40.0), margin=0.75)
    steps = [(c.formats, c.kept) for c in found.checks if c.kind == "descent"]
    assert steps == [((INT4,) * 3, False), ((INT4, INT8_TOK, INT8_TOK), True), ((INT4, INT4, INT4), False),
                     ((INT4, INT4, INT8_TOK), False), ((INT4, INT8_TOK, INT4), False)]
    assert found.formats == (INT4, INT8_TOK, INT8_TOK)
    assert found.formats == search(_Scorer(cost), [INT8_TOK, INT4], max_pct=1.0, validator=_Scorer(cost, 40.0),
                                   margin=0.75).formats  # the candidates' order does not matter


def test_search_stops_naming_the_budget_when_no_uniform_fits():
    cost = _costs([0.01] * 3, [0.02] * 3, [0.02] * 3, [0.05] * 3)
    with pytest.raises(AccuracyBudgetError, match=r"accuracy.max_perplexity_increase_pct=1%.*int8-per_token"):
        search(_Scorer(cost), [INT8_TOK, INT4], max_pct=1.0)


# -------------------------------------------------------------------- search
def _own_text(model, model_dir, n: int, length: int) -> torch.Tensor:
    """n windows the model itself wrote (greedy from random 4-token prompts): text it predicts well, so KV
    quantization raises its NLL (on random tokens a random model's NLL moves either way)."""
    from calibration.engine_check import evaluation_engine

    eng = evaluation_engine(model, model_dir, (FP32,) * model.cfg.num_layers, longest=length, batch=n)
    try:
        prompts = torch.randint(3, 500, (n, 4), generator=torch.Generator().manual_seed(0)).tolist()
        return torch.tensor([p + g.token_ids for p, g in zip(prompts, eng.generate(
            prompts, max_tokens=length - 4, ignore_eos=True))])
    finally:
        eng.shutdown()


def test_search_on_a_tiny_model_is_deterministic_and_never_above_the_best_uniform(tiny4):
    model = load_model(tiny4)
    cfg = model.cfg
    text = _own_text(model, tiny4, 4, 32)
    windows, checks = text[:2], text[2:]
    cands = [INT4, FP32, INT8_TOK]  # any order
    # the uniform formats on the check windows, scored here through the engine, not by the search
    judge = EngineScorer(model, tiny4, checks, {})
    base = judge.nll((FP32,) * 4)
    change = {f: judge.nll((f,) * 4) - base for f in cands}
    assert change[INT4] > max(0.0, change[INT8_TOK])  # the tiny model feels int4 most
    target = change[INT4] / 2  # int4 does not fit; fp32 (0) does, int8 by its measured change
    pct = float(torch.tensor(target / 0.75, dtype=torch.float64).expm1() * 100)
    best = min((f for f in cands if change[f] <= target), key=lambda f: kv_bytes_per_token(cfg, (f,) * 4))

    def run(pct):
        scorer = EngineScorer(model, tiny4, windows, {})
        found = search(scorer, cands, max_pct=pct, validator=EngineScorer(model, tiny4, checks, {}), margin=0.75)
        return found, scorer.passes

    (a, passes), (b, _) = run(pct), run(pct)
    assert a.formats == b.formats and a.sensitivity == b.sensitivity
    assert [(c.formats, c.measured_nll) for c in a.checks] == [(c.formats, c.measured_nll) for c in b.checks]
    assert a.start == best
    assert kv_bytes_per_token(cfg, a.formats) <= kv_bytes_per_token(cfg, (best,) * 4)
    assert judge.nll(a.formats) - base <= target
    if best == INT8_TOK:  # sensitivities relative to the start: the options below it (K8V4, K4V8, int4) x 4 layers
        assert passes == 2 + 4 * 3 and a.sensitivity.candidates == (INT8_TOK, K4V8, K8V4, INT4)
    # a budget every format meets: every layer ends in the smallest pairing, int4 K and V
    assert run(1e6)[0].formats == (INT4,) * 4


# ------------------------------------------------------------------ pipeline
TINY_AUTO = ["--recipe", "synthetic-8b-int8kv", "--set", "model.preset=tiny-llama3", "--set", "model.dtype=fp32",
             "--set", "kv.dtype=auto", "--set", "search.formats=[fp32, int8-per_head, int4-per_token-asym]",
             "--set", "search.num_samples=2", "--set", "search.seq_len=32", "--set", "accuracy.perplexity_tokens=64",
             "--set", "build.max_batch_size=2", "--set", "build.max_input_len=64", "--set", "build.max_seq_len=128",
             "--set", "build.block_size=16", "--device", "cpu"]


def test_search_stage_builds_the_chosen_engine(tmp_path, capsys):
    from helpers_cli import run_cli

    from builder.pipeline import read_manifest
    from builder.planner import make_plan
    from triton_repo.repo_torch import engine_kv_format, engine_model_spec

    work = ["--work-dir", str(tmp_path)]
    code, out = run_cli(["build", *TINY_AUTO, *work, "--dry-run"], capsys)
    assert code == 0 and "search" in out and "would run" in out, out
    code, out = run_cli(["build", *TINY_AUTO, *work, "--until", "build"], capsys)
    assert code == 0, out
    search_dir = tmp_path / "engines" / "synthetic-8b-int8kv" / "search"
    engine_dir = search_dir.parent / "engine"
    result = json.loads((search_dir / "search.json").read_text())
    assert (search_dir / "search.png").stat().st_size > 0 and "| layer | format |" in (search_dir / "search.md").read_text()
    # the engine stores what the search chose, and the choice meets its budget on held-out data
    assert json.loads((engine_dir / "kv_format.json").read_text()) == json.loads((search_dir / "kv_format.json").read_text())
    assert result["heldout"]["auto"]["ppl_change_pct"] <= 1.0
    assert set(result["heldout"]) == {"auto", "_baseline", "fp32", "int8-per_head", "int4-per_token-asym"}
    # the descent started from a uniform candidate that fit on the check windows and only lowered bytes
    start = next(c for c in result["checks"] if c["kind"] == "uniform" and c["kept"])
    assert start["formats"] == result["start"] and start["measured_pct"] <= 0.75 * 1.0
    assert result["bytes_per_token"] <= result["heldout"][result["start"]]["bytes_per_token"]
    eng = Engine.from_dir(engine_dir, num_blocks=4)
    try:
        assert [f.name for f in eng.formats] == result["layer_formats"]
        assert eng.stats.kv_bytes_per_token == result["bytes_per_token"]
        assert eng.stats.pool_allocated_bytes == 4 * 16 * result["bytes_per_token"]
    finally:
        eng.shutdown()
    assert engine_kv_format(engine_dir) == result["kv_format"]
    assert engine_model_spec(engine_dir, 2, {"device": "", "instance_count": 1, "max_queue_delay_us": 0}
                             ).parameters["kv_format"] == result["kv_format"]
    # the choice pinned as a recipe (recipe_kv.yaml) plans the same bytes per token
    import yaml

    pinned = yaml.safe_load((search_dir / "recipe_kv.yaml").read_text())["kv"]["layers"]
    sets = [v for k, v in zip(TINY_AUTO, TINY_AUTO[1:]) if k == "--set" and v.startswith(("model.", "build."))]
    r = load_recipe("synthetic-8b-int8kv", [*sets, f"kv.layers={json.dumps(pinned)}"])
    row = next(p for p in make_plan(r).formats if p.recipe_format)
    assert row.bytes_per_token == result["bytes_per_token"]
    code, out = run_cli(["build", *TINY_AUTO, *work, "--until", "build"], capsys)
    assert code == 0 and read_manifest(search_dir)["stage"] == "search"
    assert out.count("up to date") >= 4, out  # convert, calibrate, search, build
