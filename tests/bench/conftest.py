"""A tiny fake OpenAI completions server on loopback, so loadgen is tested over real HTTP + SSE."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


@dataclass
class FakeBehaviour:
    reject_ids: bool = False  # 400 on token-id prompts (a server without the extension)
    status: int | None = None  # answer every completion with this HTTP error
    fail_every: int = 0  # every k-th completion gets HTTP 500
    stream_error_every: int = 0  # every k-th completion breaks mid-stream with an error event
    token_delay: float = 0.0
    send_usage: bool = True
    calls: int = 0
    prompts: list = field(default_factory=list)


def make_app(b: FakeBehaviour):
    # FastAPI resolves `req: Request` from module globals (annotations are strings here).
    app = FastAPI()

    def err(code: int, msg: str):
        return JSONResponse({"error": {"message": msg, "type": "invalid_request_error", "code": code}},
                            status_code=code)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(req: Request):
        body = await req.json()
        b.calls += 1
        n = b.calls
        prompt = body.get("prompt")
        b.prompts.append(prompt)
        if b.status:
            return err(b.status, "forced error")
        if b.reject_ids and isinstance(prompt, list):
            return err(400, "prompt must be a string")
        if b.fail_every and n % b.fail_every == 0:
            return err(500, "internal error")
        max_tokens = int(body.get("max_tokens", 16))
        n_prompt = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())

        async def gen():
            for i in range(max_tokens):
                if b.token_delay:
                    await asyncio.sleep(b.token_delay)
                if b.stream_error_every and n % b.stream_error_every == 0 and i == 1:
                    yield "data: " + json.dumps({"error": {"message": "worker died", "code": 500}}) + "\n\n"
                    return
                choice = {"index": 0, "text": f" t{i}", "finish_reason": None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [100 + i]
                yield "data: " + json.dumps({"id": "c", "object": "text_completion", "choices": [choice]}) + "\n\n"
            yield "data: " + json.dumps({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]}) + "\n\n"
            if b.send_usage and (body.get("stream_options") or {}).get("include_usage"):
                usage = {"prompt_tokens": n_prompt, "completion_tokens": max_tokens}
                yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    return app


class FakeServer:
    """Any ASGI app under uvicorn on a loopback port bound up front (no port race), in a thread."""

    def __init__(self, behaviour: FakeBehaviour | None = None, app=None, lifespan: str = "off"):
        import uvicorn

        self.behaviour = behaviour
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(app if app is not None else make_app(behaviour), log_level="error", lifespan=lifespan)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started and time.time() < deadline:
            time.sleep(0.01)
        assert self.server.started, "fake server did not start"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def fake_server():
    """Factory: fake_server(**behaviour) -> FakeServer, stopped at teardown."""
    servers = []

    def start(**kw) -> FakeServer:
        s = FakeServer(FakeBehaviour(**kw))
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()


@pytest.fixture
def free_port() -> int:
    """A loopback port nobody listens on (bound then released)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


@pytest.fixture
def serve_asgi():
    """Factory: serve_asgi(app) -> FakeServer running that app (lifespan on), stopped at teardown."""
    servers = []

    def start(app) -> FakeServer:
        s = FakeServer(app=app, lifespan="on")
        servers.append(s)
        return s

    yield start
    for s in servers:
        s.stop()
