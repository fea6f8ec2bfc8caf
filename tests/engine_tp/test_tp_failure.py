"""A rank that dies or stops answering fails the worker: the step errors within the compute timeout (never
hangs), requests in flight end with a clear error, /health turns 503 "failed" and new requests are refused."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdcluster.worker.engine.async_engine import AsyncEngine
from pdcluster.worker.engine.llm_engine import LLMEngine
from pdcluster.worker.engine.sampling_params import SamplingParams
from pdcluster.worker.server.app import build_app
from pdcluster.worker.server.lifecycle import engine_fault

from ..netutil import serve
from .conftest import alive, tp_config

TIMEOUT_S = 3.0  # the compute group's timeout in these tests


def test_killed_follower_faults_the_engine(tp_models: dict[str, Path], make_tp_engine: Any) -> None:
    engine: LLMEngine = make_tp_engine(tp_models["llama"], 2, tensor_parallel_timeout=TIMEOUT_S)
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert engine.fault is None and engine_fault(engine) is None
    (pid,) = engine.runner.pids  # type: ignore[union-attr]
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60  # the watcher's next poll; generous for a loaded machine
    while engine.fault is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.fault is not None and "rank 1" in engine.fault and "exited" in engine.fault
    assert engine_fault(engine) == engine.fault
    engine.add_request("after", [4, 5, 6], SamplingParams(max_tokens=3, temperature=0.0))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1"):
        engine.step()
    assert time.monotonic() - t0 < TIMEOUT_S - 0.5  # refused at once: no collective is even tried
    engine.abort("after")


def test_stopped_follower_errors_in_flight_request_and_fails_health(tp_models: dict[str, Path]) -> None:
    engine = AsyncEngine(LLMEngine(tp_config(tp_models["llama"], 2, tensor_parallel_timeout=TIMEOUT_S)))
    (pid,) = engine.engine.runner.pids  # type: ignore[union-attr]
    app = build_app(engine, role="both", served_model_name="m", request_timeout=120)
    body = {"model": "m", "prompt": [1, 2, 3, 4, 5], "max_tokens": 240, "temperature": 0, "ignore_eos": True,
            "stream": True}
    try:
        with serve(app) as url, httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/health").status_code == 200
            os.kill(pid, signal.SIGSTOP)  # alive but silent: only the compute timeout can tell
            t0 = time.monotonic()
            with client.stream("POST", "/v1/completions", json=body) as r:  # in flight when the step stalls
                events = [line for line in r.iter_lines() if line.startswith("data: ")]
            waited = time.monotonic() - t0
            assert waited < TIMEOUT_S + 45, waited  # bounded by the compute timeout, not hung (slack: a loaded machine)
            errors = [json.loads(e[6:])["error"] for e in events if e != "data: [DONE]" and '"error"' in e]
            assert errors and "tensor-parallel" in errors[0]["message"], events[-3:]
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "failed", health.text
            assert "tensor-parallel" in health.json()["error"]
            refused = client.post("/v1/completions", json={**body, "stream": False})
            assert refused.status_code == 503 and "tensor-parallel" in refused.json()["error"]["message"]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
        engine.shutdown()
        engine.engine.close()
    assert not alive(pid)
