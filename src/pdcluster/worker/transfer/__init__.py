"""pdcluster.worker.transfer: moving KV cache between workers.

`frame.py` is the versioned, authenticated wire format, `codec.py` turns KV tensors into frames (optionally
int8 on the wire), `transport.py` the TCP transport, `connector.py` the backend that plugs into the
engine's KV connector interface, `secret.py` the shared secret and the internal bearer token derived
from it.

Must not: import the HTTP apps; the server wires a connector in.
"""
