"""`pdcluster bench` and `pdcluster profile --url` against a real worker (engine + HTTP server, in process)."""

import json

import pytest

from pdcluster.cli import main

pytest.importorskip("torch", reason="a real worker needs the worker extra (torch)")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from pdcluster.worker.engine.async_engine import AsyncEngine
    from pdcluster.worker.engine.llm_engine import EngineConfig
    from pdcluster.worker.local.demo_model import build_demo_model

    model = build_demo_model(tmp_path_factory.mktemp("bench-worker"), hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, max_position_embeddings=256, tokenizer=False)
    eng = AsyncEngine.from_config(EngineConfig(model=str(model), block_size=8, num_kv_blocks=128,
                                               max_batch_size=4, num_threads=1))
    yield eng
    eng.shutdown()


@pytest.mark.slow
def test_bench_and_profile_against_a_real_worker(engine, serve_asgi, tmp_path, capsys):
    from pdcluster.worker.server.app import build_app

    url = serve_asgi(build_app(engine, role="both", served_model_name="demo", request_timeout=60)).url
    rc = main(["bench", "--url", url, "--prompt-lens", "4,12", "--output-lens", "3", "--requests", "2",
               "--concurrency", "2", "--no-progress", "--out", str(tmp_path)])
    assert rc == 0, capsys.readouterr()
    cells = json.loads((tmp_path / "results.json").read_text())
    for c in cells:
        assert c["errors"] == 0, c["error_kinds"]
        assert c["mean_output_tokens"] == 3  # ignore_eos + max_tokens honoured by our server
        assert c["ttft_p50"] > 0 and c["tpot_p50"] > 0
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["request_shape"]["ids"] is True and meta["model"] == "demo"
    capsys.readouterr()
    assert main(["profile", "--url", url, "--batch-sizes", "1,2", "--prefill-len", "16",
                 "--prefill-concurrency", "1", "--decode-len", "4", "--json"]) == 0
    prof = json.loads(capsys.readouterr().out)
    assert prof["prefill_tokens_per_second"] > 0 and prof["decode_tokens_per_second"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [True, False])
def test_served_vs_hf_clients_read_the_same_tokens(engine, serve_asgi, stream):
    """served_vs_hf's two load clients (aiohttp, httpx) parse the same tokens out of the same responses, and
    each reports the CPU it spent (it runs on the server's cores)."""
    import asyncio
    from urllib.parse import urlsplit

    from benchmarks.served_client import served_run
    from pdcluster.worker.server.app import build_app

    url = serve_asgi(build_app(engine, role="both", served_model_name="demo", request_timeout=60)).url
    port = urlsplit(url).port
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    got = {c: asyncio.run(served_run(port, prompts, 5, stream, c)) for c in ("aiohttp", "httpx")}
    ids = {c: r[2] for c, r in got.items()}
    assert ids["aiohttp"] == ids["httpx"] and all(len(i) == 5 for i in ids["aiohttp"])
    for whole, decode, _, cpu in got.values():
        assert whole > 0 and cpu > 0
        assert (decode > 0) if stream else decode != decode  # NaN: no decode rate without a stream
