"""Per-layer KV formats: engine directories, recipes, pool sizing, and the search that chooses them."""

from __future__ import annotations

import json

import pytest
import torch
from helpers_runtime import tiny_llama_dir
from safetensors.torch import save_file

from calibration.layer_search import EngineScorer, Sensitivity, choose, measure_sensitivity, repair, search
from calibration.loading import load_model
from recipes import load_recipe
from recipes.kv_section import layer_ranges, parse_layer_ranges
from runtime.config import ModelConfig
from runtime.engine import Engine
from runtime.errors import InputError, RecipeError, UnsupportedError
from runtime.kv_format import KVFormat
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


def test_repair_moves_the_most_sensitive_per_byte_layers_up_first():
    s = _sens([[0, 0.5, 5.0], [0, 0.01, 0.02], [0, 0.1, 0.3]])
    # layer 0's int4 step costs 4.5 per byte given back, layer 2's 0.2, layer 1's 0.01
    assert repair(s, [2, 2, 2], excess=1.0) == [1, 2, 2]
    assert repair(s, [2, 2, 2], excess=4.6) == [0, 2, 2]  # then layer 0's int8 step (0.25 per byte)
    assert repair(s, [2, 2, 2], excess=5.1) == [0, 2, 1]
    assert repair(s, [0, 0, 0], excess=1.0) == [0, 0, 0]  # nothing left to give back
    assert repair(s, [2, 2, 2], excess=0.0, min_steps=2) == [0, 2, 2]  # steps counted even when free
    assert Sensitivity.from_dict(s.to_dict(), lambda n: {f.name: f for f in s.candidates}[n]) == s


class _Model:
    dtype = torch.float32

    class cfg:
        num_layers, num_kv_heads, head_dim = 3, 1, 1


class _Scorer:
    """NLL of a choice: the layers' true costs (sens x interaction), additive: a stand-in for data where
    the sensitivities under-predict the whole by `interaction`."""

    def __init__(self, s: Sensitivity, interaction: float):
        self.s, self.interaction, self.model, self.passes = s, interaction, _Model(), 0

    def nll(self, formats) -> float:
        self.passes += 1
        if formats[0] == KVFormat("fp32"):
            return 0.0
        return self.interaction * sum(self.s.sens[i][self.s.candidates.index(f)] for i, f in enumerate(formats))


def test_search_repairs_a_choice_that_misses_on_validation_windows():
    s = _sens([[0, 0.002, 0.02], [0, 0.0005, 0.001], [0, 0.001, 0.004]])
    goal = float(torch.log1p(torch.tensor(0.01)))
    # the sensitivity windows agree with the prediction; the validation windows see 3x the loss
    choice, rounds = search(_Scorer(s, 1.0), s, max_pct=1.0, validator=_Scorer(s, 3.0), margin=0.75)
    assert [r.data for r in rounds][0] == "calibration" and rounds[-1].data == "validation"
    first = next(r for r in rounds if r.data == "validation")
    assert first.measured_nll > 0.75 * goal  # the unrepaired choice misses on validation data
    assert rounds[-1].measured_nll <= 0.75 * goal  # the repaired one meets margin x budget there
    assert 3.0 * sum(s.sens[i][j] for i, j in enumerate(choice)) <= 0.75 * goal
    assert choice != [0, 0, 0]  # and still saves bytes
    # without a validator the choice is the calibration windows' one, made against margin x budget
    plain, plain_rounds = search(_Scorer(s, 1.0), s, max_pct=1.0, margin=0.75)
    assert plain == first.choice and all(r.data == "calibration" for r in plain_rounds)
    assert sum(s.sens[i][j] for i, j in enumerate(plain)) <= 0.75 * goal


# -------------------------------------------------------------------- search
def test_search_on_a_tiny_model_is_deterministic(tiny4):
    g = torch.Generator().manual_seed(0)
    windows = torch.randint(3, 500, (2, 32), generator=g)
    cands = [INT4, FP32, INT8_TOK]  # any order: the ladder sorts them by bytes

    def run():
        scorer = EngineScorer(load_model(tiny4), tiny4, windows, {}, batch_invariant=True)
        s = measure_sensitivity(scorer, cands)
        # a budget between the cheapest and the dearest single int4 layer forces a mixed choice
        int4 = sorted(row[2] for row in s.sens)
        assert int4[-1] > 0  # the tiny model feels int4 in some layer, so a budget below it binds
        pct = (torch.tensor((int4[0] + int4[-1]) / 2).expm1() * 100).item()
        choice, rounds = search(scorer, s, max_pct=pct)
        return s, choice, rounds, scorer.passes

    a, b = run(), run()
    assert a[0].sens == b[0].sens and a[0].base_nll == b[0].base_nll
    assert a[1] == b[1] and [r.measured_nll for r in a[2]] == [r.measured_nll for r in b[2]]
    s, choice, rounds, passes = a
    assert s.candidates == (FP32, INT8_TOK, INT4) and passes == 2 + 4 * 2 + len(rounds)
    assert len(set(choice)) > 1  # the budget admits some int4 layers, not all


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
