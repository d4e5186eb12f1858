"""Engine.score: teacher-forced log-probabilities through the engine's own pool, kernels and chunking.

References that are not the code under test: the runtime model's dense forward in
fp64-compared log-softmax (unquantized KV), transformers' LlamaForCausalLM on the
real SmolLM2 weights, and token-by-token decode through the same engine (its
`ModelRunner` fed one true token per step) for quantized KV.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
import helpers_calibration as H  # noqa: E402

from runtime.config import ModelConfig  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.errors import RequestError  # noqa: E402
from runtime.kv_format import KVFormat  # noqa: E402
from runtime.sampling import SamplingParams  # noqa: E402
from runtime.scheduler import Sequence, Step  # noqa: E402

QUANTIZED = [KVFormat("int8", "per_token"), KVFormat("int4", "per_token", symmetric=False),
             KVFormat("fp8_e4m3", "per_tensor"), KVFormat("int4", "per_head")]


def _engine(model_dir, fmt: KVFormat, num_blocks: int = 64, **kw) -> Engine:
    scales = None
    if fmt.static:  # fixed, plausible dequant scales: these tests compare two paths, not calibrations
        cfg = ModelConfig.from_dir(model_dir)
        shape = (cfg.num_layers,) if fmt.granularity == "per_tensor" else (cfg.num_layers, cfg.num_kv_heads)
        qmax = {"fp8_e4m3": 448.0, "int8": 127.0, "int4": 7.0}[fmt.dtype]
        scales = {"k_scale": torch.full(shape, 4.0 / qmax), "v_scale": torch.full(shape, 2.0 / qmax)}
    return Engine.from_dir(model_dir, kv_format=fmt, kv_scales=scales, num_blocks=num_blocks, block_size=16, **kw)


def _dense_logprobs(model, ids: list[int]) -> torch.Tensor:
    logits = model.forward_dense(torch.tensor(ids)).double()
    return torch.log_softmax(logits, -1)[:-1].gather(-1, torch.tensor(ids)[1:, None]).squeeze(-1)


def decode_logprobs(engine: Engine, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]), t >= 1, by token-by-token decode through the engine's runner:
    a one-token prefill, then one decode step per true token (teacher forcing)."""
    key = ("decode-reference", id(ids))
    seq = Sequence(key, ids[:1], SamplingParams(max_tokens=len(ids)))
    engine.blocks.allocate(key, 1)
    rows = [engine.runner.run(Step(decode=[], prefill=[seq], spans=[(0, 1)]))[0]]
    try:
        for t in range(1, len(ids) - 1):
            seq.output_ids.append(ids[t])
            engine.blocks.append(key)
            rows.append(engine.runner.run(Step(decode=[seq], prefill=[], spans=[]))[0])
    finally:
        engine.blocks.free(key)
    logp = torch.log_softmax(torch.stack(rows).double(), -1)
    return logp.gather(-1, torch.tensor(ids)[1:, None]).squeeze(-1)


def _random_ids(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def tiny():
    return H.tiny_model_dir()


# ------------------------------------------------------------ unquantized
def test_score_equals_dense_forward_across_windows_and_chunks(tiny):
    eng = _engine(tiny, KVFormat("fp32"))
    try:
        seqs = [_random_ids(n, eng.cfg.vocab_size, n) for n in (100, 37, 200, 2)]
        starts = [1, 30, 1, 1]
        passes = []
        res = eng.score(seqs, start=starts, tokens_per_pass=64, on_pass=passes.append)  # 200 tokens: 4 chunks
        for ids, s, r in zip(seqs, starts, res):
            ref = _dense_logprobs(eng.model, ids)[s - 1 :]
            assert r.start == s and r.logprobs.shape == ref.shape
            assert float((r.logprobs.double() - ref).abs().max()) < 2e-5
            logits = eng.model.forward_dense(torch.tensor(ids))[s - 1 : -1]
            assert torch.equal(r.argmax, logits.argmax(-1))
        assert sum(passes) == sum(len(s) for s in seqs) and max(passes) <= 64
        assert eng.blocks.num_free_blocks == eng.blocks.num_blocks  # every window's pages came back
    finally:
        eng.shutdown()


def test_passes_that_score_nothing(tiny):
    """A long context scored only at its end (a passkey): the first passes carry no scored token."""
    eng = _engine(tiny, KVFormat("fp32"))
    try:
        ids = _random_ids(150, eng.cfg.vocab_size, 3)
        passes = []
        (r,) = eng.score([ids], start=[140], tokens_per_pass=32, on_pass=passes.append)
        ref = _dense_logprobs(eng.model, ids)[139:]
        assert len(passes) == 5 and r.logprobs.shape == ref.shape == (10,)
        assert float((r.logprobs.double() - ref).abs().max()) < 2e-5
    finally:
        eng.shutdown()


def test_score_rejects_bad_input_naming_the_field(tiny):
    eng = _engine(tiny, KVFormat("fp32"), num_blocks=8)
    v = eng.cfg.vocab_size
    try:
        cases = [([], "non-empty list"), ([[5]], r"sequences\[0\] has 1 tokens"),
                 ([[1, 2], [1, v]], r"sequences\[1\] has token ids outside"),
                 ([list(range(1, 200))], r"needs 13 KV blocks, the pool has 8")]
        for seqs, msg in cases:
            with pytest.raises(RequestError, match=msg):
                eng.score(seqs)
        with pytest.raises(RequestError, match=r"start\[0\] = 3 must be in \[1, 2\]"):
            eng.score([[1, 2, 3]], start=3)
        with pytest.raises(RequestError, match="`start` has 1 entries for 2 sequences"):
            eng.score([[1, 2], [3, 4]], start=[1])
        assert eng.blocks.num_free_blocks == 8
    finally:
        eng.shutdown()


def test_score_while_generating_changes_neither(tiny):
    """Scoring takes the engine between steps: generation running at the same time keeps its tokens,
    and the scores equal those of an idle engine."""
    fmt = KVFormat("int8", "per_token")
    eng = _engine(tiny, fmt, num_blocks=128)
    try:
        prompts = [_random_ids(20, eng.cfg.vocab_size, s) for s in range(4)]
        seqs = [_random_ids(90, eng.cfg.vocab_size, 10 + s) for s in range(6)]
        sp = SamplingParams(max_tokens=24, ignore_eos=True)
        solo_gen = [g.token_ids for g in eng.generate(prompts, sp)]
        solo = eng.score(seqs, tokens_per_pass=64)
        got = {}
        t = threading.Thread(target=lambda: got.setdefault("gen", [g.token_ids for g in eng.generate(prompts, sp)]))
        t.start()
        both = eng.score(seqs, tokens_per_pass=64)
        t.join()
        assert got["gen"] == solo_gen
        for a, b in zip(solo, both):
            assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.argmax, b.argmax)
    finally:
        eng.shutdown()


# -------------------------------------------------------------- quantized
@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
def test_quantized_score_equals_token_by_token_decode(tiny, fmt):
    """One prefill pass per window reads the K/V as stored, exactly what decode reads. The engine runs
    in its batch-invariant mode (the CPU default): without it a T-row projection and a 1-row one differ
    in the last bits, and the quantizer can turn that into a different code (int4 per_head here: 1.1e-2)."""
    eng = _engine(tiny, fmt)
    try:
        ids = _random_ids(96, eng.cfg.vocab_size, 7)
        ref = decode_logprobs(eng, ids)
        whole = eng.score([ids])[0].logprobs.double()
        dense = _dense_logprobs(eng.model, ids)
        assert float((whole - ref).abs().max()) < 2e-5
        assert float((whole - dense).abs().max()) > 1e-4  # the quantization is really in the path
    finally:
        eng.shutdown()


@pytest.mark.parametrize("fmt", QUANTIZED, ids=lambda f: f.name)
def test_chunking_never_changes_scores(tiny, fmt):
    """Write, then read: where a window's chunk boundaries fall changes no score."""
    eng = _engine(tiny, fmt)
    try:
        ids = _random_ids(96, eng.cfg.vocab_size, 7)
        whole = eng.score([ids])[0].logprobs
        for budget in (40, 17):
            assert float((eng.score([ids], tokens_per_pass=budget)[0].logprobs - whole).abs().max()) < 5e-6
    finally:
        eng.shutdown()


# ------------------------------------------------------------ real SmolLM2
@pytest.fixture(scope="module")
def smol_text_ids():
    from calibration.perplexity import eval_windows

    return eval_windows(H.load_tokenizer_fast(), 512, 256)


@pytest.mark.slow
def test_smollm2_score_equals_transformers(smol_text_ids):
    eng = Engine.from_dir(H.smollm2_dir(), kv_format=KVFormat("fp32"), num_blocks=64)
    try:
        res = eng.score([w.tolist() for w in smol_text_ids], tokens_per_pass=384)  # the second window is chunked
    finally:
        eng.shutdown()
    hf = H.smollm2_hf_model()
    with torch.inference_mode():
        logits = hf(input_ids=smol_text_ids).logits.double()
    ref = torch.log_softmax(logits, -1)[:, :-1].gather(-1, smol_text_ids[:, 1:, None]).squeeze(-1)
    ours = torch.stack([r.logprobs for r in res]).double()
    diff = float((ours - ref).abs().max())
    print(f"SmolLM2 unquantized: max |engine - transformers| log p = {diff:.2e}")
    assert diff <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("fmt", QUANTIZED[:2], ids=lambda f: f.name)
def test_smollm2_quantized_score_equals_decode(smol_text_ids, fmt):
    eng = Engine.from_dir(H.smollm2_dir(), kv_format=fmt, num_blocks=64)
    try:
        ids = smol_text_ids[0, :192].tolist()
        diff = float((eng.score([ids])[0].logprobs.double() - decode_logprobs(eng, ids)).abs().max())
    finally:
        eng.shutdown()
    print(f"SmolLM2 {fmt.name}: max |score - token-by-token decode| log p = {diff:.2e}")
    assert diff < 1e-4
