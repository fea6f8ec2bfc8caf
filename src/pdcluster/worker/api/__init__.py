"""pdcluster.worker.api: the OpenAI-compatible protocol, shared by the worker server and the router.

Request bodies (strict pydantic models), the one capped body parser, response/chunk shaping, OpenAI-shaped
errors, prompt rendering (text and chat templates to token ids) and the `pdcluster_*` Prometheus metrics.

Must not: import the engine's runtime (torch) or the server/router apps; both of those import this.
"""
