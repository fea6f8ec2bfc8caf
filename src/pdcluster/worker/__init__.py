"""pdcluster.worker: the inference stack, one idea per sub-package.

- `engine/`   the model and everything that runs it in one process (no HTTP, no network)
- `api/`      the OpenAI protocol shared by the worker server and the router (bodies, errors, metrics)
- `server/`   one worker's HTTP app, request lifecycle and internal disaggregation routes; `pdcluster serve`
- `router/`   the router in front of the prefill and decode pools; `pdcluster router`
- `transfer/` KV-cache transfer between workers (frames, codec, transports)
- `local/`    `pdcluster up`: router + workers as local processes

Nothing here imports `pdcluster.bench` or benchmarks/ (they depend on the runtime, never the other way round),
and nothing here imports `pdcluster.operator` except `local/` (the laptop cluster reuses the operator's
autoscaler core so that `up --autoscale` decides exactly as the operator does).
"""
