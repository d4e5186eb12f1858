"""A CPU engine computes on the process's one compute thread (runtime/compute_thread.py): its load, every step of
its step loop and every scoring pass run there, whichever thread calls, so the process keeps one OpenMP pool."""

from __future__ import annotations

import threading

import pytest
from helpers_runtime import tiny_llama_dir

from runtime import compute_thread, model, runner
from runtime.engine import Engine


def test_run_executes_on_one_thread_for_every_caller():
    seen: list[str] = []

    def where() -> str:
        return threading.current_thread().name

    seen.append(compute_thread.run(where))
    t = threading.Thread(target=lambda: seen.append(compute_thread.run(where)))
    t.start()
    t.join()
    assert seen[0].startswith("kvq-compute") and seen[0] == seen[1] != threading.current_thread().name
    # called from the compute thread itself: inline (a queued call would wait for itself)
    assert compute_thread.run(lambda: compute_thread.run(where)) == seen[0]


def test_run_raises_the_callers_exception():
    def boom():
        raise KeyError("x")

    with pytest.raises(KeyError, match="x"):
        compute_thread.run(boom)
    assert compute_thread.run(lambda: 7) == 7  # the thread survives


def test_cpu_engine_loads_steps_and_scores_on_the_compute_thread(tmp_path_factory, monkeypatch):
    threads: dict[str, set[str]] = {"load": set(), "forward": set()}
    real_init, real_forward = model.LlamaModel.__init__, runner.ModelRunner.forward

    def init(self, *a, **kw):
        threads["load"].add(threading.current_thread().name)
        real_init(self, *a, **kw)

    def forward(self, batch):
        threads["forward"].add(threading.current_thread().name)
        return real_forward(self, batch)

    monkeypatch.setattr(model.LlamaModel, "__init__", init)
    monkeypatch.setattr(runner.ModelRunner, "forward", forward)
    eng = Engine.from_dir(tiny_llama_dir(tmp_path_factory), device="cpu", num_blocks=64)
    try:
        loaded = set(threads["load"])
        prompts = [[1, 2, 3, 4, 5], [7, 8, 9]]
        gen = eng.generate(prompts, max_tokens=4, ignore_eos=True)
        stepped = set(threads["forward"])
        threads["forward"].clear()
        # scoring from another thread while a request is in flight: both go through the compute thread
        done = threading.Event()
        eng.submit([3, 1, 4, 1, 5], None, lambda tok, fin, *_: fin and done.set())
        scores = []
        t = threading.Thread(target=lambda: scores.append(eng.score([p + g.token_ids for p, g in zip(prompts, gen)])))
        t.start()
        t.join(60)
        assert done.wait(60) and scores
    finally:
        eng.shutdown()
    assert len(loaded) == 1 and loaded.pop().startswith("kvq-compute")
    assert len(stepped) == 1 and stepped.pop().startswith("kvq-compute")
    assert len(threads["forward"]) == 1 and threads["forward"].pop().startswith("kvq-compute")
    # scoring the generated tokens: greedy's argmax at every generated position
    for p, g, s in zip(prompts, gen, scores[0]):
        assert s.argmax[len(p) - 1:].tolist()[:len(g.token_ids)] == g.token_ids
