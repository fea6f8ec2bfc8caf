"""A rank SIGKILLed exactly mid-transfer on the direct path between TP layouts (each rank its own endpoint):
`PDCLUSTER_TEST_TP_KILL_AFTER_LAYER=0` makes a follower rank kill itself right after it sent (prefill) or
imported (decode) layer 0 of the 2-layer model's first request, so the transfer is always cut half way. The
request ends (an error, or the router's fallback to prefilling on the decode worker), nothing hangs, the
faulted worker's /health is 503, and no surviving rank of either worker holds a block, a pending load, a send
or a NIXL registration."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from pdcluster.worker.server.tp_rank import KILL_ENV

from .harness import AUTH
from .test_tp_layouts import HANG_S, NIXL, assert_ranks_clean, model, prompts, reference, tp_cluster  # noqa: F401

pytestmark = pytest.mark.slow
BACKENDS = ["tcp", pytest.param("nixl", marks=NIXL)]


def _quiet(url: str, seconds: float = 120) -> dict[str, object]:
    """/internal/load once nothing is held any more (or as it is when time is up)."""
    deadline = time.monotonic() + seconds
    while True:
        d = httpx.get(f"{url}/internal/load", headers=AUTH, timeout=5).json()
        if (d["used_blocks"] == 0 and d["pending_loads"] == 0 and d["in_flight"] == 0) or time.monotonic() > deadline:
            return d
        time.sleep(0.2)


def _request(router: str) -> httpx.Response:
    """One request; a hang fails it at the client's read timeout (test_tp_layouts.HANG_S), no timing assert."""
    body = {"model": "tiny", "prompt": prompts()[-1], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    return httpx.post(f"{router}/v1/completions", json=body, timeout=HANG_S)


def _assert_faulted_and_clean(urls: dict[str, str], faulted: str) -> None:
    """After a follower of ``faulted`` died: that worker is unhealthy, both sides hold nothing, every surviving
    rank is clean and the faulted worker reports exactly its rank 1 dead."""
    deadline = time.monotonic() + 120  # the worker learns of its rank's death from the control channel
    while httpx.get(f"{urls[faulted]}/health", timeout=5).status_code != 503:
        assert time.monotonic() < deadline, f"{faulted} still healthy 120 s after its rank 1 died"
        time.sleep(0.2)
    for role in ("prefill", "decode"):
        d = _quiet(urls[role])
        assert d["used_blocks"] == 0 and d["pending_loads"] == 0 and d["in_flight"] == 0, (role, d)
    assert_ranks_clean(urls, skip_dead=True)
    ranks = httpx.get(f"{urls[faulted]}/internal/load?ranks=1", headers=AUTH, timeout=15).json()["kv_ranks"]
    assert [bool(x.get("dead")) for x in ranks] == [False, True], ranks


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_follower_killed_mid_transfer(model: Path, tmp_path: Path, backend: str) -> None:  # noqa: F811
    """Prefill TP 2 -> decode TP 1: prefill rank 1 dies after sending its heads of layer 0."""
    with tp_cluster(model, tmp_path, 2, 1, backend, env={"prefill": {KILL_ENV: "0"}}) as c:
        urls = c["urls"]
        assert isinstance(urls, dict)
        r = _request(urls["router"])
        assert r.status_code in (200, 500, 502, 503), r.text
        if r.status_code == 200:  # the router's fallback prefilled on the decode worker: still the right tokens
            assert r.json()["choices"][0]["token_ids"] == reference(model, [prompts()[-1]])[0]
        _assert_faulted_and_clean(urls, "prefill")


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_follower_killed_mid_transfer(model: Path, tmp_path: Path, backend: str) -> None:  # noqa: F811
    """Prefill TP 1 -> decode TP 2: decode rank 1 dies after importing its heads of layer 0."""
    with tp_cluster(model, tmp_path, 1, 2, backend, env={"decode": {KILL_ENV: "0"}}) as c:
        urls = c["urls"]
        assert isinstance(urls, dict)
        r = _request(urls["router"])
        assert r.status_code in (200, 500, 502, 503), r.text
        _assert_faulted_and_clean(urls, "decode")
