"""Worker pool bookkeeping, DNS service resolution, and the router CLI's argument checks."""

from __future__ import annotations

import argparse
import socket

import pytest

from pdcluster.worker.router import cli
from pdcluster.worker.router.pool import Pool, parse_service, resolve_service


def test_resolve_service_gives_one_url_per_address() -> None:
    urls = resolve_service("localhost:8123")
    assert urls and all(u.startswith("http://") and u.endswith(":8123") for u in urls)
    # the operator renders Service URLs: http://<name>-prefill.<ns>.svc:8000
    assert resolve_service("http://localhost:8124") and all(u.endswith(":8124") for u in resolve_service("http://localhost:8124"))
    assert parse_service("http://pd-prefill.ns.svc:8000") == ("http", "pd-prefill.ns.svc", 8000)
    assert parse_service("pd-decode") == ("http", "pd-decode", 8000)
    assert parse_service("pd-decode:9000") == ("http", "pd-decode", 9000)


def _dns(monkeypatch: pytest.MonkeyPatch, answer: list[str] | int) -> None:
    """getaddrinfo answering these addresses, or failing with this EAI_* code."""
    def getaddrinfo(host: str, port: int, *a: object, **kw: object) -> list[tuple]:
        if isinstance(answer, int):
            raise socket.gaierror(answer, "test")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in answer]
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_a_dns_server_that_does_not_answer_keeps_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup that fails without an answer (EAI_AGAIN: CoreDNS starved on a busy node, seen in e2e) says nothing
    about the Service: its workers stay. An answer without the address (a headless Service without ready pods:
    NXDOMAIN) is a worker gone."""
    pool = Pool(decode_services=["http://pd-decode.ns.svc:8000"])
    _dns(monkeypatch, ["10.0.0.7", "10.0.0.8"])
    pool.refresh_services()
    assert sorted(w.url for w in pool.pool("decode")) == ["http://10.0.0.7:8000", "http://10.0.0.8:8000"]
    _dns(monkeypatch, socket.EAI_AGAIN)
    assert resolve_service("http://pd-decode.ns.svc:8000") is None
    pool.refresh_services()
    assert len(pool.pool("decode")) == 2
    _dns(monkeypatch, ["10.0.0.8"])
    pool.refresh_services()
    assert [w.url for w in pool.pool("decode")] == ["http://10.0.0.8:8000"]
    _dns(monkeypatch, socket.EAI_NONAME)
    assert resolve_service("http://pd-decode.ns.svc:8000") == []
    pool.refresh_services()
    assert pool.pool("decode") == []


async def test_pool_marks_and_snapshot() -> None:
    pool = Pool(prefill_urls=["http://127.0.0.1:1/"], decode_urls=["http://127.0.0.1:2"])
    assert [w.url for w in pool.pool("prefill")] == ["http://127.0.0.1:1"]
    assert not pool.any_healthy()  # nobody is healthy before a probe answered
    await pool.probe_all()  # nothing listens on ports 1 and 2
    assert not pool.any_healthy()
    w = pool.get("decode", "http://127.0.0.1:2")
    w.healthy = True
    pool.mark_failed("decode", w.url, "connection refused")
    snap = pool.snapshot()
    assert snap["decode"][0]["healthy"] is False and snap["decode"][0]["last_error"] == "connection refused"
    await pool.stop()


def test_cli_requires_a_decode_pool(capsys) -> None:  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.run(p.parse_args(["--prefill", "http://x:1"])) == 2
    assert "decode" in capsys.readouterr().err
    args = p.parse_args(["--decode", "http://a:1", "http://b:2", "--prefill-service", "pf:8000",
                         "--max-queue-depth", "4", "--disaggregation-threshold", "32"])
    assert args.decode == ["http://a:1", "http://b:2"] and args.prefill_service == ["pf:8000"]
    app = cli.build(args)
    state = app.state.router
    assert state.max_queue_depth == 4 and state.flow.threshold == 32


def test_cli_decode_wait_reaches_the_flow_and_is_checked(capsys) -> None:  # type: ignore[no-untyped-def]
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    assert cli.build(p.parse_args(["--decode", "http://a:1", "--decode-wait", "7.5"])).state.router.flow.decode_wait == 7.5
    assert cli.build(p.parse_args(["--decode", "http://a:1"])).state.router.flow.decode_wait == 30.0
    with pytest.raises(SystemExit) as e:  # refused at parse time, one argparse error line
        p.parse_args(["--decode", "http://a:1", "--decode-wait", "-1"])
    assert e.value.code == 2 and "argument --decode-wait" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["pdcluster", "vllm"])
async def test_a_busy_worker_that_answers_late_stays_a_dead_one_goes(engine: str) -> None:
    """A probe that times out drops an idle worker after two in a row, a worker busy with requests only after
    BUSY_DROP_AFTER (a server saturated by its own work answers late without being down); a busy worker that
    refuses connections is not protected."""
    import httpx

    from pdcluster.worker.router.picking import BUSY_DROP_AFTER, DROP_AFTER

    slow = {"http://127.0.0.1:11", "http://127.0.0.1:12"}

    def handler(request: httpx.Request) -> httpx.Response:
        url = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if url in slow:
            raise httpx.ReadTimeout("no answer within the probe timeout", request=request)
        raise httpx.ConnectError("connection refused", request=request)

    pool = Pool(prefill_urls=["http://127.0.0.1:11", "http://127.0.0.1:13"], decode_urls=["http://127.0.0.1:12"],
                engine=engine)
    await pool.client.aclose()
    pool.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    busy, dead = pool.get("prefill", "http://127.0.0.1:11"), pool.get("prefill", "http://127.0.0.1:13")
    idle = pool.get("decode", "http://127.0.0.1:12")
    for w in (busy, idle, dead):
        w.healthy = True
    busy.running, dead.in_flight = 2, 1  # busy: a batch at its last answer; dead: a request of ours in flight
    for n in range(1, BUSY_DROP_AFTER + 1):
        await pool.probe_all()
        assert busy.healthy == (n < BUSY_DROP_AFTER), n
        assert idle.healthy == (n < DROP_AFTER), n
        assert dead.healthy == (n < DROP_AFTER), n
    assert "ReadTimeout" in (busy.last_error or "")
    await pool.stop()
