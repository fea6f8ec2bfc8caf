import random

import httpx
import pytest

from pdcluster.bench import loadgen


@pytest.mark.parametrize(
    "url, want",
    [
        ("http://h:8000", "http://h:8000/v1/completions"),
        ("http://h:8000/", "http://h:8000/v1/completions"),
        ("http://h:8000/v1", "http://h:8000/v1/completions"),
        ("http://h:8000/v1/completions", "http://h:8000/v1/completions"),
        ("https://h/prefix", "https://h/prefix/v1/completions"),
    ],
)
def test_completions_url(url, want):
    assert loadgen.completions_url(url) == want


@pytest.mark.parametrize("url", ["localhost:8000", "ftp://h", "", "http://"])
def test_bad_urls_are_rejected_with_a_message(url):
    with pytest.raises(loadgen.BadURL, match="not an http"):
        loadgen.completions_url(url)


def test_count_chunk_tokens():
    assert loadgen.count_chunk_tokens({"choices": [{"text": "a", "token_ids": [1, 2]}]}) == 2
    assert loadgen.count_chunk_tokens({"choices": [{"text": "a"}]}) == 1
    assert loadgen.count_chunk_tokens({"choices": [{"text": ""}]}) == 1  # a partial UTF-8 character
    assert loadgen.count_chunk_tokens({"choices": [{"text": "", "finish_reason": "length"}]}) == 0
    assert loadgen.count_chunk_tokens({"choices": [], "usage": {}}) == 0


def test_payload_has_exact_prompt_length_and_extensions():
    p = loadgen.build_payload(37, 5, random.Random(1), loadgen.SHAPES[0], "m")
    assert isinstance(p["prompt"], list) and len(p["prompt"]) == 37
    assert p["max_tokens"] == 5 and p["ignore_eos"] and p["stream"] and p["model"] == "m"
    text = loadgen.build_payload(37, 5, random.Random(1), loadgen.SHAPES[3])
    assert isinstance(text["prompt"], str) and len(text["prompt"].split()) == 37
    assert "ignore_eos" not in text and "model" not in text


def test_poisson_arrivals_are_deterministic_and_have_the_right_mean():
    a = loadgen.poisson_arrivals(4000, 20.0, random.Random(3))
    assert a == loadgen.poisson_arrivals(4000, 20.0, random.Random(3))
    assert a[0] == 0.0 and all(y >= x for x, y in zip(a, a[1:], strict=False))
    assert a[-1] / len(a) == pytest.approx(1 / 20.0, rel=0.1)
    with pytest.raises(ValueError):
        loadgen.poisson_arrivals(3, 0, random.Random(0))


async def _one(url, payload, timeout=10.0):
    async with loadgen.make_client(2, timeout) as c:
        return await loadgen.stream_one(c, loadgen.completions_url(url), payload, timeout)


async def test_stream_one_measures_tokens(fake_server):
    s = fake_server(token_delay=0.002)
    r = await _one(s.url, loadgen.build_payload(9, 6, random.Random(0), loadgen.SHAPES[0]))
    assert r.ok, r.detail
    assert r.output_tokens == 6 and r.prompt_tokens == 9
    assert 0 < r.ttft <= r.latency and r.tpot is not None and len(r.itl) == 5


async def test_stream_one_counts_chunks_without_usage(fake_server):
    s = fake_server(send_usage=False)
    r = await _one(s.url, loadgen.build_payload(3, 4, random.Random(0), loadgen.SHAPES[3]))
    assert r.ok and r.output_tokens == 4  # the empty finish chunk is not a token


@pytest.mark.parametrize(
    "behaviour, kind",
    [({"status": 429}, "http_429"), ({"fail_every": 1}, "http_500"), ({"stream_error_every": 1}, "stream_error")],
)
async def test_stream_one_errors_become_results(fake_server, behaviour, kind):
    s = fake_server(**behaviour)
    r = await _one(s.url, loadgen.build_payload(3, 4, random.Random(0), loadgen.SHAPES[0]))
    assert not r.ok and r.error == kind and r.detail


async def test_unreachable_is_a_connect_error(free_port):
    r = await _one(f"http://127.0.0.1:{free_port}", {"prompt": "x", "max_tokens": 1, "stream": True})
    assert not r.ok and r.error == "connect"


async def test_probe_falls_back_to_text_when_ids_are_rejected(fake_server):
    s = fake_server(reject_ids=True)
    async with loadgen.make_client(2, 10) as c:
        probe = await loadgen.probe_shape(c, loadgen.completions_url(s.url), None, 10)
        assert probe.shape == {"ids": False, "ext": True}
        assert await loadgen.discover_model(c, s.url) == "fake-model"


async def test_run_requests_closed_and_open_loop(fake_server):
    s = fake_server()
    url = loadgen.completions_url(s.url)
    rng = random.Random(0)
    payloads = [loadgen.build_payload(4, 3, rng, loadgen.SHAPES[0]) for _ in range(8)]
    seen = []
    async with loadgen.make_client(8, 10) as c:
        res, wall = await loadgen.run_requests(c, url, payloads, concurrency=3, on_done=seen.append)
        assert len(res) == 8 and all(r.ok for r in res) and len(seen) == 8 and wall > 0
        res, _ = await loadgen.run_requests(c, url, payloads, rate=200.0, seed=1)
        assert len(res) == 8 and all(r.ok for r in res)


async def test_discover_model_returns_none_when_unreachable(free_port):
    async with httpx.AsyncClient() as c:
        assert await loadgen.discover_model(c, f"http://127.0.0.1:{free_port}") is None
