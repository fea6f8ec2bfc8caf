"""pdcluster.worker.server: one worker process (`pdcluster serve`).

`app.py` holds the public routes, `lifecycle.py` admission (503 when not ready, 429 with Retry-After when
full, 504 on timeout) and each request's life over the async engine, `internal_routes.py` the
authenticated `/internal/*` endpoints that run one side of a disaggregated request, `cli.py` the command
line that builds an engine and serves it.

Must not: hold engine logic (it calls the engine's public API) or router logic.
"""
