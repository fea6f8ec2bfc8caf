"""`pdcluster serve`: user mistakes are one error line + exit 2; a real process serves and stops cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pdcluster.cli import main
from pdcluster.worker.engine.options import parse_bytes as _bytes
from pdcluster.worker.server.cli import TransferOptions

from .harness import free_port, wait_until


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    try:
        code = main(["serve", *argv])
    except SystemExit as e:  # argparse errors
        code = int(e.code or 0)
    err = capsys.readouterr().err
    return code, [ln for ln in err.splitlines() if ln.strip()]


def assert_one_error_line(code: int, lines: list[str], *needles: str) -> None:
    assert code == 2
    errors = [ln for ln in lines if "error" in ln]
    assert len(errors) == 1, lines
    assert not any("Traceback" in ln for ln in lines)
    for n in needles:
        assert n in errors[0], errors[0]


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([], "--model"),
        (["--model", "m", "--block-size", "7"], "--block-size"),
        (["--model", "m", "--role", "router"], "--role"),
        (["--model", "m", "--port", "70000"], "--port"),
        (["--model", "m", "--max-batch-size", "0"], "--max-batch-size"),
        (["--model", "m", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--model", "m", "--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--model", "m", "--kv-transfer-compression", "zstd"], "--kv-transfer-compression"),
        (["--model", "m", "--full-precision-layers", "a,b"], "--full-precision-layers"),
        (["--model", "m", "--unknown-flag"], "--unknown-flag"),
    ],
)
def test_bad_flags(argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_error_line(*run_cli(argv, capsys), needle)


def test_missing_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_error_line(*run_cli(["--model", str(tmp_path / "nope")], capsys), "not a directory")
    assert_one_error_line(*run_cli(["--model", str(tmp_path)], capsys), "config.json")


def test_unsupported_model_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_one_error_line(*run_cli(["--model", str(tmp_path), "--port", str(free_port())], capsys), "gpt2")


def test_model_folder_without_weights(demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((demo_model_dir / name).read_bytes())
    assert_one_error_line(*run_cli(["--model", str(tmp_path), "--port", str(free_port())], capsys), "weights")


def test_missing_secret_file(demo_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(demo_model_dir), "--kv-transfer-secret-file", "/no/such/secret"]
    assert_one_error_line(*run_cli(argv, capsys), "secret")


def test_bad_chat_template_file(demo_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--model", str(demo_model_dir), "--chat-template"]
    assert_one_error_line(*run_cli([*argv, str(tmp_path / "none.jinja")], capsys), "--chat-template", "cannot read")
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    assert_one_error_line(*run_cli([*argv, str(bad)], capsys), "--chat-template", "line 1")


def test_busy_port(demo_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert_one_error_line(*run_cli(["--model", str(demo_model_dir), "--port", str(port)], capsys), str(port))


def test_cuda_without_gpu(demo_model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    argv = ["--model", str(demo_model_dir), "--device", "cuda", "--port", str(free_port())]
    assert_one_error_line(*run_cli(argv, capsys), "CUDA")


def test_byte_sizes() -> None:
    assert _bytes("1000") == 1000 and _bytes("2Gi") == 2 * 2**30 and _bytes("512M") == 512 * 10**6
    assert TransferOptions().compression == "none"


def test_serve_process_end_to_end(demo_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    template = tmp_path / "t.jinja"
    template.write_text("<<{% for m in messages %}{{ m.role }}={{ m.content }};{% endfor %}>>")
    cmd = [sys.executable, "-m", "pdcluster", "serve", "--model", str(demo_model_dir), "--port", str(port),
           "--role", "decode", "--served-model-name", "tiny", "--kv-cache-memory", "4Mi", "--threads", "1",
           "--max-batch-size", "4", "--log-level", "warning", "--chat-template", str(template)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return proc.poll() is not None  # stop waiting if it died

        assert wait_until(healthy, timeout=300, interval=0.2)  # a loaded 2-core CI box: startup took >120 s once
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        r = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 3
        assert httpx.get(f"{url}/health").json()["role"] == "decode"
        ids = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert httpx.post(f"{url}/detokenize", json={"tokens": ids}).json()["prompt"] == "<<user=hi;>>"
        assert 'role="decode"' in httpx.get(f"{url}/metrics").text
        # the event loop (main thread) never preempts a step on wake-up; the engine thread stays a normal one
        policies = {os.sched_getscheduler(int(t)) for t in os.listdir(f"/proc/{proc.pid}/task")}
        assert os.sched_getscheduler(proc.pid) == os.SCHED_BATCH and os.SCHED_OTHER in policies
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    # uvicorn shuts down gracefully, then re-raises SIGTERM so the exit status says why it stopped
    assert proc.returncode in (0, -signal.SIGTERM), out
    assert "Traceback" not in out
