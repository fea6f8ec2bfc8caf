"""pdcluster.worker.router: the router in front of the prefill and decode pools (`pdcluster router`).

`picking.py` holds the pure decisions (which prefill and decode worker, whether to disaggregate),
`pool.py` the workers' health and discovery, `flow.py` one request's journey with retries and mid-stream
resume, `app.py` the HTTP face, `cli.py` the command line.

Must not: import the engine or torch (the router has no model); it talks to workers over HTTP only.
"""
