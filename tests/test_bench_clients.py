"""`kvq bench --openai`'s clients: built once per worker, before any request's clock starts.

Building an openai.OpenAI client costs ~30 ms of CPU under the GIL (httpx's SSL context); one per
request serialized the workers' sends and put that cost into every TTFT (2.0 s at 64 streams on CPU).
"""

from __future__ import annotations

import threading
import time
import types

import pytest

openai = pytest.importorskip("openai")

from triton_repo import bench  # noqa: E402

BUILD_S = 0.1  # a client build far slower than a request, so counting it in TTFT cannot hide


class _SlowClient:
    built = 0
    lock = threading.Lock()

    def __init__(self, **kw):
        time.sleep(BUILD_S)
        with _SlowClient.lock:
            _SlowClient.built += 1
        chunk = types.SimpleNamespace(choices=[types.SimpleNamespace(text="w1 ")])
        self.completions = types.SimpleNamespace(create=lambda **kw: iter([chunk, chunk]))

    def close(self):
        pass


def test_openai_clients_are_built_per_worker_outside_the_ttft_clock(monkeypatch):
    monkeypatch.setattr(openai, "OpenAI", _SlowClient)
    _SlowClient.built = 0
    res = bench.run_bench("http://127.0.0.1:1/v1", concurrency=4, num_requests=12, max_tokens=2, openai=True,
                          model="m", apply_chat_template=False, keep_token_times=True)
    assert res["summary"]["errors"] == 0
    assert _SlowClient.built == 4  # one per worker, not one per request
    ttfts = [r["ttft_s"] for r in res["requests"]]
    assert len(ttfts) == 12 and max(ttfts) < BUILD_S / 2, ttfts
