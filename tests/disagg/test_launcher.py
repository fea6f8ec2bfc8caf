"""The supervisor behind `pdcluster up`: restart with backoff, clean stop. (`up` itself, with real
processes, SIGKILLs and restarts, is exercised end to end in test_faults.py.)"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from pdcluster.worker.local import launcher
from pdcluster.worker.local.supervisor import CrashLoop, Supervisor, backoff
from pdcluster.worker.router import cli as router_cli


def test_backoff_grows_and_caps() -> None:
    assert [backoff(n) for n in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 8, 10, 10]


def test_supervisor_restarts_a_dead_child_and_stops_all(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    p = sup.add("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    first = p.pid
    assert first is not None
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 30
    events: list[str] = []
    while p.pid == first and time.monotonic() < deadline:
        events += sup.poll()
        time.sleep(0.05)
    assert p.pid != first and p.alive and p.restarts == 1
    assert any("exited" in e for e in events) and any("restarted" in e for e in events)
    sup.stop(timeout=5)
    assert not p.alive


_DEAF = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
         "print('ready', flush=True); time.sleep(60)"]  # a worker whose drain never ends


def _start_deaf(sup: Supervisor, name: str) -> int:
    p = sup.add(name, _DEAF)
    deadline = time.monotonic() + 30
    while b"ready" not in sup.log_path(name).read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.pid is not None
    return p.pid


def _poll_while(sup: Supervisor, cond: object, seconds: float) -> list[str]:
    events: list[str] = []
    deadline = time.monotonic() + seconds
    while cond() and time.monotonic() < deadline:  # type: ignore[operator]
        events += sup.poll()
        time.sleep(0.05)
    return events


def test_scale_down_returns_while_the_worker_drains_and_kills_it_at_the_deadline(tmp_path: Path) -> None:
    # Regression: disable() used to wait for the exit, freezing `up`'s loop (autoscaler, restarts) for
    # up to 10 s per worker scaled down.
    sup = Supervisor(tmp_path)
    _start_deaf(sup, "w")
    p = sup.procs["w"]
    sup.disable("w", timeout=1.0)
    assert p.alive and not p.enabled  # still draining when disable() returns
    events = _poll_while(sup, lambda: p.alive or p.drain_until is not None, 30)
    assert not p.alive and p.drain_until is None and p.restarts == 0
    assert any("scaled down" in e for e in events)
    assert not any("restart" in e for e in events)  # a scale-down is not a crash
    sup.stop(timeout=5)


def test_scale_up_during_a_drain_starts_a_new_process_once_the_old_one_exits(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    old = _start_deaf(sup, "w")
    p = sup.procs["w"]
    sup.disable("w", timeout=1.0)
    sup.enable("w")
    assert p.enabled and p.pid == old  # counted as running; the old one still holds the port
    events = _poll_while(sup, lambda: p.pid == old, 30)
    assert p.pid != old and p.alive and p.restarts == 0
    assert any("started again after draining" in e for e in events)
    sup.disable("w", timeout=1.0)
    _poll_while(sup, lambda: p.alive, 30)
    sup.stop(timeout=5)
    assert not p.alive


def _exit_with(code: int, message: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; print({message!r}, file=sys.stderr); sys.exit({code})"]


def _poll_until_raises(sup: Supervisor, seconds: float) -> CrashLoop:
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            sup.poll()
            time.sleep(0.05)
    except CrashLoop as e:
        return e
    finally:
        sup.stop(timeout=5)
    raise AssertionError(f"the supervisor kept restarting for {seconds} s")


def test_a_usage_error_stops_the_supervisor_with_the_childs_message(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    p = sup.add("decode-0", _exit_with(2, "pdcluster serve: error: argument --threads: '0' must be >= 1"))
    e = _poll_until_raises(sup, 10)
    assert e.name == "decode-0" and e.code == 2 and p.restarts == 0  # not restarted even once
    assert "argument --threads: '0' must be >= 1" in str(e)


def test_a_child_failing_at_start_is_restarted_a_bounded_number_of_times(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path, max_restarts=2)  # backoff 1 s then 2 s: gives up after about 3 s
    p = sup.add("prefill-0", _exit_with(1, "RuntimeError: no model here"))
    e = _poll_until_raises(sup, 20)
    assert e.code == 1 and p.restarts == 2
    assert "failed 3 times in a row" in str(e) and "RuntimeError: no model here" in str(e)


def _up_args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdcluster up")
    launcher.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv,said", [
    (["--port", "99999"], "argument --port: '99999' is not a TCP port (1-65535)"),
    (["--port", "0"], "argument --port: '0' is not a TCP port"),
    (["--threads", "0"], "argument --threads: '0' must be >= 1"),
    (["--decode", "0"], "argument --decode: '0' must be >= 1"),
    (["--prefill", "-1"], "argument --prefill: '-1' must be >= 0"),
    (["--max-workers", "0"], "argument --max-workers: '0' must be >= 1"),
])
def test_up_refuses_bad_numbers_at_parse_time(argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        _up_args(*argv)
    assert e.value.code == 2 and said in capsys.readouterr().err


def test_up_refuses_worker_ports_past_65535_before_building_anything(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _up_args("--port", "65534", "--prefill", "1", "--decode", "2", "--cache-dir", str(tmp_path))
    assert launcher.run(args) == 2
    assert "--port 65534 leaves no room for the 3 worker ports" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # the demo model was not built


@pytest.mark.parametrize("url", ["notaurl", "ftp://a:1", "http://:8000", "http://a", "http://a:99999",
                                 "http://a:port", "http://a:1/?x=1"])
def test_router_refuses_a_worker_url_that_is_not_one(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="pdcluster router")
    router_cli.add_arguments(p)
    for flag in ("--prefill", "--decode"):
        with pytest.raises(SystemExit) as e:
            p.parse_args([flag, url])
        assert e.value.code == 2 and f"argument {flag}: {url!r} is not a worker URL" in capsys.readouterr().err


def test_router_accepts_worker_urls_and_ports() -> None:
    p = argparse.ArgumentParser(prog="pdcluster router")
    router_cli.add_arguments(p)
    args = p.parse_args(["--decode", "http://127.0.0.1:8001/", "https://d.svc:443", "--port", "9000"])
    assert args.decode == ["http://127.0.0.1:8001", "https://d.svc:443"] and args.port == 9000
    with pytest.raises(SystemExit):
        p.parse_args(["--decode", "http://a:1", "--port", "70000"])


def test_up_passes_decode_wait_and_routing_to_a_router_that_accepts_them() -> None:
    from pdcluster.worker.local import launcher
    from pdcluster.worker.router import cli as router_cli

    args = _up_args("--decode-wait", "7.5", "--routing", "least-loaded")
    cmd = launcher.router_cmd(args, ["http://127.0.0.1:8081"], ["http://127.0.0.1:8082"])
    p = argparse.ArgumentParser()
    router_cli.add_arguments(p)
    parsed = p.parse_args(cmd[cmd.index("router") + 1:])
    assert parsed.decode_wait == 7.5 and parsed.routing == "least-loaded"


def test_up_passes_the_tool_call_parser_to_the_router_and_every_worker(tmp_path: Path) -> None:
    from pdcluster.worker.server import cli as serve_cli

    args = _up_args("--tool-call-parser", "hermes")
    router = launcher.router_cmd(args, ["http://127.0.0.1:8081"], ["http://127.0.0.1:8082"])
    worker = launcher.worker_cmd(args, tmp_path, "decode", 8082)
    for cmd, add in ((router, router_cli.add_arguments), (worker, serve_cli.add_arguments)):
        p = argparse.ArgumentParser()
        add(p)
        sub = "router" if cmd is router else "serve"
        assert p.parse_args(cmd[cmd.index(sub) + 1 :]).tool_call_parser == "hermes"
    plain = _up_args()  # no flag: no parser anywhere ("auto" stays a 400 naming the flag)
    assert "--tool-call-parser" not in launcher.router_cmd(plain, [], ["http://127.0.0.1:8082"])
    assert "--tool-call-parser" not in launcher.worker_cmd(plain, tmp_path, "decode", 8082)


def test_up_passes_each_pool_its_tensor_parallel_size(tmp_path: Path) -> None:
    from pdcluster.worker.server import cli as serve_cli

    args = _up_args("--prefill-tp", "2", "--decode-tp", "4")
    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    for role, tp in (("prefill", 2), ("decode", 4)):
        cmd = launcher.worker_cmd(args, tmp_path, role, 8082)
        assert p.parse_args(cmd[cmd.index("serve") + 1 :]).tensor_parallel_size == tp
    plain = _up_args("--decode-tp", "1")  # TP 1: the worker command line of before, no flag at all
    assert "--tensor-parallel-size" not in launcher.worker_cmd(plain, tmp_path, "decode", 8082)
