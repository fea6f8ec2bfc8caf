"""How close to raw TCP can a Python frame loop get at all? The transport's own frame code with no asyncio.

    python -m pdcluster.bench.transfer_bound [--sizes-mib 1,16] [--reps 15] [--ack last|each]

The TCP backend stays near 60 % of raw TCP at 1 MiB layers (docs/benchmarks/disaggregation.md §0). This
measures the ceiling of the design rather than of the code around it: the same `frame.py` functions the
backend runs — `seal_frame` (header, three GMAC tags a frame), `parse_preamble` and `parse_placed` (header
checks, the tags verified over the bytes where they landed), one ACK frame sealed and parsed — driven by
blocking sockets and plain threads (a thread reads the ACKs): no event loop, no futures, no timeouts, no
outbox or placement bookkeeping. `--ack last` acknowledges only a request's last layer (what a cumulative ACK
would cost). No handshake: the two processes share fixed keys (the handshake is once per connection).

Raw TCP is `transfer_pair`'s own raw path (its `raw_once` and `raw_sink`: `sendall` of each layer, `recv_into`
straight into the destination, one byte back) in the same two processes, rounds interleaved; each cell is the median, and
"paired" the median over rounds of raw's time / the frame loop's.

Beside them, the floor of any frame loop that MACs its payloads here, however native: `mac` is raw's loop plus
the transport's payload GMAC (`FrameKey.tag` over each layer before its `sendmsg`, `FrameKey.check` where it
landed) and nothing else, no header, no ACK per layer; `mac-after` tags after the send, when the bytes are hot.
If these stay under 70 % of raw, no rewrite of the frame code reaches 70 % on this machine with this MAC.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from pdcluster.bench.transfer_pair import (
    DIM,
    HEADS,
    RAW_HEAD,
    LayerCache,
    raw_once,
    raw_requests,
    raw_sink,
    request_layers,
    tokens_of,
)
from pdcluster.worker.transfer.frame import (
    PREAMBLE_SIZE,
    TAG_SIZE,
    TRAILER_SIZE,
    DType,
    Frame,
    FrameKey,
    Gathered,
    Kind,
    ack,
    parse_body,
    parse_placed,
    parse_preamble,
    seal_frame,
)
from pdcluster.worker.transfer.sockio import consume

KEY_DATA, KEY_ACK = b"d" * 32, b"a" * 32  # fixed keys: the handshake is not what is measured


def shape(mib: int) -> tuple[int, int]:
    """(layers, tokens) of a request of `mib`-MiB layers, as transfer_pair sizes one."""
    return request_layers(mib << 20), tokens_of(mib << 20)


# Blocking counterparts of sockio.Conn's receive and send (which wait on the event loop: what this leaves out).
def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError("peer closed")
        got += k


def recv_parts(sock: socket.socket, views: Sequence[memoryview]) -> None:
    todo = [v for v in views if len(v)]
    while todo:
        k = sock.recvmsg_into(todo)[0]
        if k == 0:
            raise EOFError("peer closed")
        consume(todo, k)


def send_all(sock: socket.socket, parts: Sequence[Any]) -> None:
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    while views:
        consume(views, sock.sendmsg(views[:512]))


def mac_sink(srv: socket.socket, cache: LayerCache) -> None:
    """Child thread: raw_sink's loop with a 16-byte GMAC after each layer, checked over the bytes where they
    landed; a bad tag closes the connection (the sender's wait for the request's byte then fails)."""
    conn, _ = srv.accept()
    dst, key, seq = cache.kv.view(torch.uint8).numpy(), FrameKey(KEY_DATA), 0
    tag = memoryview(bytearray(TAG_SIZE))
    with conn:
        for layers, n in raw_requests(conn):
            for layer in range(layers):
                view = memoryview(dst[layer]).cast("B")[:n]
                recv_parts(conn, [view, tag])
                if not key.check(b"pay", seq, view, tag):
                    return
                seq += 1
            conn.sendall(b"k")


def mac_once(sock: socket.socket, layers: list[memoryview], key: FrameKey, seq: int, after: bool) -> float:
    """One request through mac_sink: each layer with its GMAC, tagged before its send or (`after`) once it is sent."""
    t0 = time.perf_counter()
    sock.sendall(RAW_HEAD.pack(len(layers), len(layers[0])))
    for i, data in enumerate(layers):
        if after:
            send_all(sock, [data])
            sock.sendall(key.tag(b"pay", seq + i, data))
        else:
            send_all(sock, [data, key.tag(b"pay", seq + i, data)])
    if sock.recv(1) != b"k":
        raise RuntimeError("mac sink refused a tag or closed")
    return time.perf_counter() - t0


def _receiver(pipe: Connection, mib: int, ack_each: bool) -> None:
    layers, tokens = shape(mib)
    cache = LayerCache(layers, tokens, codes=False)
    cache.kv.zero_()  # first touch here, not in a timed round
    dst = cache.kv.numpy()
    raw_srv, srv, mac_srv = (socket.create_server(("127.0.0.1", 0)) for _ in range(3))
    pipe.send((raw_srv.getsockname()[1], srv.getsockname()[1], mac_srv.getsockname()[1]))
    sinks = [threading.Thread(target=raw_sink, args=(raw_srv, {False: cache}), daemon=True),
             threading.Thread(target=mac_sink, args=(mac_srv, cache), daemon=True)]
    for t in sinks:
        t.start()
    try:
        _frame_loop(srv, dst, ack_each)
    finally:  # the sender closes the sinks' connections first: let them return before the process exits
        for t in sinks:
            t.join(5)


def _frame_loop(srv: socket.socket, dst: np.ndarray, ack_each: bool) -> None:
    conn, _ = srv.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    key_in, key_out = FrameKey(KEY_DATA), FrameKey(KEY_ACK)
    seq_in = seq_out = 0
    pre, tags = memoryview(bytearray(PREAMBLE_SIZE)), memoryview(bytearray(TRAILER_SIZE))
    while True:
        try:
            recv_exact(conn, pre)
        except EOFError:
            return
        hdr = parse_preamble(pre, key_in, seq_in)
        meta = memoryview(bytearray(hdr.request_id_len + hdr.scales_len))
        recv_exact(conn, meta)
        kv = dst[hdr.layer, :, hdr.token_start:hdr.token_end]
        views = [memoryview(kv[0]).cast("B"), memoryview(kv[1]).cast("B")]
        recv_parts(conn, views)
        recv_exact(conn, tags)
        frame = parse_placed(hdr, meta, views, tags, key_in, seq_in)
        seq_in += 1
        if ack_each or frame.layer == frame.num_layers - 1:
            send_all(conn, seal_frame(ack(frame.request_id, frame.layer), key_out, seq_out))
            seq_out += 1


class _Sender:
    def __init__(self, port: int, src: np.ndarray, ack_each: bool) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.src, self.ack_each = src, ack_each
        self.key_out, self.key_in = FrameKey(KEY_DATA), FrameKey(KEY_ACK)
        self.seq_out = self.seq_in = 0
        self.acked = 0

    def _acks(self, n: int) -> None:
        try:
            self._read_acks(n)
        except (EOFError, OSError):
            pass  # the receiver closed: `request` sees the ACKs missing

    def _read_acks(self, n: int) -> None:
        pre = memoryview(bytearray(PREAMBLE_SIZE))
        for _ in range(n):
            recv_exact(self.sock, pre)
            hdr = parse_preamble(pre, self.key_in, self.seq_in)
            body = memoryview(bytearray(hdr.body_len))
            recv_exact(self.sock, body)
            parse_body(hdr, body, self.key_in, self.seq_in)
            self.seq_in += 1
            self.acked += 1

    def request(self, rid: str) -> float:
        layers, _, tokens = self.src.shape[:3]
        want, self.acked = (layers if self.ack_each else 1), 0
        reader = threading.Thread(target=self._acks, args=(want,), daemon=True)
        reader.start()
        t0 = time.perf_counter()
        for layer in range(layers):
            parts = [memoryview(self.src[layer, 0]).cast("B"), memoryview(self.src[layer, 1]).cast("B")]
            frame = Frame(kind=Kind.LAYER, request_id=rid, layer=layer, num_layers=layers, token_start=0,
                          token_end=tokens, kv_heads=HEADS, head_dim=DIM, dtype=DType.F32, payload=Gathered(parts))
            send_all(self.sock, seal_frame(frame, self.key_out, self.seq_out))
            self.seq_out += 1
        reader.join(60)
        if self.acked != want:  # the receiver refused a frame (and closed), or the ACK reader failed
            raise RuntimeError(f"{self.acked} of {want} ACKs for request {rid}")
        return time.perf_counter() - t0


def run(mib: int, reps: int, ack_each: bool = True) -> dict[str, Any]:
    """GB/s of raw TCP and of the frame loop (medians), and the paired ratio, for `reps` interleaved rounds."""
    layers, tokens = shape(mib)
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(there, mib, ack_each), daemon=True)
    proc.start()
    if not here.poll(120):
        proc.kill()
        raise RuntimeError("receiver process did not start")
    raw_port, port, mac_port = here.recv()
    src = np.random.default_rng(0).standard_normal((layers, 2, tokens, HEADS, DIM), dtype=np.float32)
    raw = socket.create_connection(("127.0.0.1", raw_port))
    raw_layers = [memoryview(src[i]).cast("B") for i in range(layers)]
    sender = _Sender(port, src, ack_each)
    mac = socket.create_connection(("127.0.0.1", mac_port))
    mac.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    mac_key, mac_seq = FrameKey(KEY_DATA), 0

    times: dict[str, list[float]] = {"raw": [], "frames": [], "mac": [], "mac-after": []}
    try:
        for rnd in range(reps + 1):  # round 0 warms up
            got = {"raw": raw_once(raw, raw_layers), "frames": sender.request(f"r{rnd}")}
            for path in ("mac", "mac-after"):
                got[path] = mac_once(mac, raw_layers, mac_key, mac_seq, after=path == "mac-after")
                mac_seq += layers
            if rnd:
                for path, t in got.items():
                    times[path].append(t)
    finally:
        raw.close()
        mac.close()
        sender.sock.close()
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    total = layers * (mib << 20)
    out: dict[str, Any] = {"mib": mib, "layers": layers, "ack": "each" if ack_each else "last"}
    for path, ts in times.items():
        out[path] = total / statistics.median(ts) / 1e9
    for path in ("frames", "mac", "mac-after"):
        key = "paired" if path == "frames" else f"paired_{path}"
        out[key] = statistics.median(r / f for r, f in zip(times["raw"], times[path], strict=True))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes-mib", default="1,16")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--ack", choices=("each", "last"), default="each")
    a = p.parse_args(argv)
    for mib in (int(m) for m in a.sizes_mib.split(",") if m):
        r = run(mib, a.reps, a.ack == "each")
        print(f"{mib:>4} MiB x {r['layers']:>2} layers, ACK {r['ack']}: raw {r['raw']:.2f} GB/s | frame loop without "
              f"asyncio {r['frames']:.2f} GB/s ({r['frames'] / r['raw']:.0%}) | paired {r['paired']:.2f}", flush=True)
        for path in ("mac", "mac-after"):
            print(f"{'':>20} raw + payload GMAC only ({path}): {r[path]:.2f} GB/s ({r[path] / r['raw']:.0%}) | "
                  f"paired {r['paired_' + path]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
