"""`pdcluster serve --tensor-parallel-size N`: refused with one error line and exit 2 when N does not fit the
model; over HTTP, TP 2 returns TP 1's completion; killing the worker (rank 0) leaves no follower behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdcluster.cli import main
from pdcluster.worker.engine.llm_engine import EngineConfig, LLMEngine
from pdcluster.worker.engine.sampling_params import SamplingParams

from ..netutil import free_port
from .conftest import alive


@pytest.fixture(scope="module")
def served_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from pdcluster.worker.local.demo_model import build_demo_model  # 4 heads over 2 KV heads, a tokenizer

    return build_demo_model(tmp_path_factory.mktemp("tp-serve"), num_hidden_layers=2, max_position_embeddings=256)


@pytest.mark.parametrize(
    "size,role,needle",
    [("3", "both", "must divide the attention head count 4"), ("0", "both", "must be >= 1"),
     ("-2", "both", "must be >= 1"), ("two", "both", "--tensor-parallel-size"),
     ("3", "decode", "must divide the attention head count 4")],
)
def test_bad_sizes_are_usage_errors(served_model: Path, capsys: pytest.CaptureFixture[str], size: str, role: str,
                                    needle: str) -> None:
    argv = ["serve", "--model", str(served_model), "--port", str(free_port()), "--role", role,
            "--tensor-parallel-size", size]
    try:
        code = main(argv)
    except SystemExit as e:  # argparse errors
        code = int(e.code or 0)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert code == 2 and len(lines) == 1 and needle in lines[0], lines
    assert "--tensor-parallel-size" in lines[0] or role != "both"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_serve_tp2_matches_tp1_and_leaves_no_orphans(served_model: Path) -> None:
    prompt, max_tokens = [5, 6, 7, 8, 9, 10], 12
    tp1 = LLMEngine(EngineConfig(model=str(served_model), num_kv_blocks=64, num_threads=1))
    want = tp1.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0]
    port = free_port()
    cmd = [sys.executable, "-m", "pdcluster", "serve", "--model", str(served_model), "--port", str(port),
           "--served-model-name", "tiny", "--kv-cache-memory", "4Mi", "--threads", "1",
           "--log-level", "warning", "--tensor-parallel-size", "2"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    followers: list[int] = []
    try:
        deadline = time.monotonic() + 280
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        followers = _children(proc.pid)
        assert len(followers) == 1, followers
        body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    finally:
        proc.kill()  # SIGKILL: rank 0 gets no chance to stop its followers itself
        proc.communicate(timeout=60)
    deadline = time.monotonic() + 60  # they see EOF on their stdin at once; slack for a loaded machine
    while any(alive(p) for p in followers) and time.monotonic() < deadline:
        time.sleep(0.1)
    leftover = [p for p in followers if alive(p)]
    for p in leftover:
        os.kill(p, signal.SIGKILL)
    assert not leftover, "a follower outlived its worker"
