"""A vLLM decode worker dying mid-stream, for real: `pdcluster up --engine vllm` with one prefill and two decode
workers (three vLLM servers, ~15 GiB: the most this suite keeps alive at once, each with 1 GiB of KV). A long
greedy stream goes prefill -> decode; at its Nth token both decode workers are frozen (SIGSTOP) and the one the
router's own in-flight accounting names is killed with its engine (SIGKILL on its process group, as a pod dies). The
client's stream goes on without a break and ends equal to one plain vLLM server's answer: no token missing,
none twice; the router counts one resume, as for our engine. The decode workers run at the lowest CPU priority,
and a stream that ends before any token event finds one holding it (a client starved on a loaded machine
reads its first tokens late) is checked whole and tried again, up to ATTEMPTS streams.

Skipped when the vLLM environment is absent (`scripts/setup.sh vllm`)."""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Iterator

import httpx
import pytest

from .test_up_vllm import PROMPTS, Up, needs_vllm, started_up

# Long enough that the frozen worker cannot have finished the stream by the time the test has read N tokens
# (the remaining ~400 tokens take seconds on any machine that runs vLLM at all), within --max-model-len 512.
MAX_TOKENS = 400
FREEZE_AT = 3
ATTEMPTS = 3  # streams tried until one is caught mid-way on a decode worker (each ends whole either way)


@pytest.fixture(scope="module")
def up3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB per worker: three share this machine
    yield from started_up(tmp_path_factory, decode=2)


def _ports_to_pids(up: Up) -> dict[int, int]:
    """Each worker's HTTP port -> its pid, from `up`'s listing (`  decode-1   pid 123  --port 4567`)."""
    return {int(m.group(2)): int(m.group(1))
            for m in re.finditer(r"^\s+\S+\s+pid (\d+)\s+--port (\d+)", "".join(up.lines), re.M)}


@pytest.mark.slow
@pytest.mark.timeout(3 * 900)  # vLLM starts in minutes under load: `up --start-timeout` bounds it, not pytest's 300 s
@needs_vllm
def test_vllm_decode_death_mid_stream_resumes_greedy_identical(up3: Up) -> None:
    assert up3.wait_line(r"^ready: "), "".join(up3.lines)
    router = f"http://127.0.0.1:{up3.port}"
    prefill = f"http://127.0.0.1:{up3.port + 1}"
    model = httpx.get(f"{router}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    # the reference: one plain vLLM server (the prefill worker asked directly, without kv_transfer_params)
    ref = httpx.post(f"{prefill}/v1/completions", json={**body, "return_token_ids": True}, timeout=600).json()
    want_text, want_ids = ref["choices"][0]["text"], ref["choices"][0]["token_ids"]
    assert len(want_ids) == MAX_TOKENS
    pids = _ports_to_pids(up3)
    snap = httpx.get(f"{router}/cluster", timeout=10).json()
    before, decode_urls = snap["router"], [w["url"] for w in snap["decode"]]
    groups = {u: os.getpgid(pids[int(u.rsplit(":", 1)[1])]) for u in decode_urls}
    # The decode workers yield the CPU to this test: on a loaded machine (make test's other workers) a starved
    # client could otherwise read its first tokens only after a decode worker has streamed all 400.
    for g in groups.values():
        os.setpriority(os.PRIO_PGRP, g, 19)

    for _attempt in range(ATTEMPTS):
        text, finish, usage, resumes_at_kill = _stream_and_kill(router, body, groups, up3)
        if resumes_at_kill is not None:
            break
        # the stream ended before any token event found a decode worker holding it: a whole answer all the same
        assert text == want_text and finish == "length", (text, finish)
    assert resumes_at_kill is not None, f"no decode worker held the stream at any token event in {ATTEMPTS} streams"
    assert text == want_text  # nothing missing, nothing twice
    assert finish == "length"
    assert usage is not None and usage["prompt_tokens"] == ref["usage"]["prompt_tokens"]  # the client's prompt
    assert usage["completion_tokens"] == MAX_TOKENS  # counted over both legs
    after = httpx.get(f"{router}/cluster", timeout=10).json()["router"]
    # the counter our engine's resumes go to (a leg that broke by itself before the kill counts before it: the
    # text above is whole either way, and more than `max_retries` would have ended in an error event)
    assert after["resumes"] == resumes_at_kill + 1, f"{resumes_at_kill - before['resumes']} resumes before the kill"



def _stream_and_kill(router: str, body: dict, groups: dict[str, int], up: Up
                     ) -> tuple[str, str | None, dict | None, int | None]:
    """One stream through the router; at the first token event (from the FREEZE_AT-th on) at which the router's
    own accounting has a decode worker holding it, that worker is killed. (text, finish, usage, the router's
    resume count at the kill or None without a kill)."""
    text, tokens, finish, usage, resumes_at_kill = "", 0, None, None, None
    with httpx.stream("POST", f"{router}/v1/completions", timeout=600,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            assert "error" not in ev, f"{ev} after {tokens} tokens (killed: {resumes_at_kill is not None}){up.log_tails()}"
            usage = ev.get("usage") or usage
            for ch in ev["choices"]:
                assert ch.get("token_ids") is None  # the router's own request for token ids stays hidden
                text += ch["text"]
                tokens += 1  # vLLM streams one token per event
                finish = ch.get("finish_reason") or finish
            if resumes_at_kill is None and tokens >= FREEZE_AT:
                # Both decode workers frozen at once, on the token event (no further token can be made: a fast
                # worker could otherwise finish the stream while the test asks), then the one holding this
                # stream by the router's own accounting, which cannot change while they are frozen. None holds
                # it between two legs (the router resuming a leg that broke by itself) or once the stream is
                # all sent: both go on, and the next token event tries again.
                for g in groups.values():
                    os.killpg(g, signal.SIGSTOP)
                frozen = httpx.get(f"{router}/cluster", timeout=10).json()
                busy = [w["url"] for w in frozen["decode"] if w["in_flight"] == 1]
                held = len(busy) == 1 and sum(w["in_flight"] for w in frozen["decode"]) == 1
                assert held or sum(w["in_flight"] for w in frozen["decode"]) == 0, frozen["decode"]  # one stream
                if held:
                    resumes_at_kill = frozen["router"]["resumes"]
                    os.killpg(groups[busy[0]], signal.SIGKILL)
                for u, g in groups.items():
                    if not held or u != busy[0]:
                        os.killpg(g, signal.SIGCONT)
    return text, finish, usage, resumes_at_kill
