"""What the router's front door reads off a request before routing it: its credentials (forwarded on public
calls to workers), its cost in the queue (the sequences it stands for), and which key its own /internal/*
calls carry."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request


def credentials(request: Request) -> dict[str, str]:
    """The client's own key goes along on public calls: workers behind a keyed router may require the same key."""
    return {"Authorization": a} if (a := request.headers.get("authorization")) else {}


def use_api_key(pool: Any, flow: Any, api_key: str | None) -> None:
    """Without a KV secret the router's /internal/* calls carry its API key instead of the internal token:
    keyed workers guard /internal/* with their key (api/api_key.py), and a keyed cluster shares one key."""
    if api_key and not getattr(pool, "headers", None):
        for client in (flow.client, getattr(pool, "client", None)):
            if client is not None:
                client.headers["Authorization"] = f"Bearer {api_key}"


def sequences(body: dict[str, Any]) -> int:
    """The engine sequences a request body stands for (prompts x n), before a worker has tokenized it: what
    it costs in the router's queue. A malformed field counts as 1; the worker's validation refuses it later."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 128 else 1
    prompt = body.get("prompt")
    batch = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 1
    return n * max(1, min(batch, 128))
