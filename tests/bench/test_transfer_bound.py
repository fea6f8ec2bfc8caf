"""The frame-loop ceiling bench runs the transport's frame code end to end between two processes."""

import socket
import threading

import numpy as np
import pytest

from pdcluster.bench import transfer_bound
from pdcluster.bench.transfer_pair import DIM, HEADS, LayerCache
from pdcluster.worker.transfer.gmac import FrameKey


@pytest.mark.parametrize("ack_each", [True, False])
def test_a_request_of_frames_is_sealed_sent_checked_and_acknowledged(ack_each: bool) -> None:
    # the receiver verifies every frame's tags (parse_placed raises otherwise) and the sender waits for the ACKs
    # it expects: a frame-format change that breaks either side fails or hangs here, not in a benchmark run
    r = transfer_bound.run(1, reps=1, ack_each=ack_each)
    assert r["layers"] == 32 and r["ack"] == ("each" if ack_each else "last")
    assert r["raw"] > 0 and r["frames"] > 0 and r["paired"] > 0
    assert r["mac"] > 0 and r["mac-after"] > 0 and r["paired_mac"] > 0 and r["paired_mac-after"] > 0


def _mac_sink_pair(mib: int = 1) -> tuple[socket.socket, LayerCache, np.ndarray, threading.Thread, list[memoryview]]:
    """A mac_sink in a thread of this process, connected, and a request's source layers."""
    layers, tokens = transfer_bound.shape(mib)
    cache = LayerCache(layers, tokens, codes=False)
    srv = socket.create_server(("127.0.0.1", 0))
    sink = threading.Thread(target=transfer_bound.mac_sink, args=(srv, cache), daemon=True)
    sink.start()
    src = np.random.default_rng(1).standard_normal((layers, 2, tokens, HEADS, DIM), dtype=np.float32)
    views = [memoryview(src[i]).cast("B") for i in range(layers)]
    return socket.create_connection(srv.getsockname()), cache, src, sink, views


@pytest.mark.parametrize("after", [False, True])
def test_the_gmac_floor_lands_every_layer_and_counts_positions(after: bool) -> None:
    sock, cache, src, sink, layers = _mac_sink_pair()
    with sock:
        key = FrameKey(transfer_bound.KEY_DATA)
        assert transfer_bound.mac_once(sock, layers, key, 0, after) > 0
        assert transfer_bound.mac_once(sock, layers, key, len(layers), after) > 0  # the next request's positions
        assert np.array_equal(cache.kv.numpy(), src)
    sink.join(5)


def test_the_gmac_floor_refuses_a_wrong_tag() -> None:
    sock, _, _, sink, layers = _mac_sink_pair()
    with sock, pytest.raises((RuntimeError, OSError)):  # the sink closes at the first bad tag
        transfer_bound.mac_once(sock, layers, FrameKey(b"x" * 32), 0, after=False)
    sink.join(5)
    assert not sink.is_alive()


def test_request_shape_matches_transfer_pair() -> None:
    from pdcluster.bench import transfer_pair

    for mib in (1, 16, 64, 256):
        layers, tokens = transfer_bound.shape(mib)
        assert layers == transfer_pair.request_layers(mib << 20) and tokens == transfer_pair.tokens_of(mib << 20)


def test_a_frame_the_receiver_refuses_fails_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # the sender seals with a key the receiver does not hold: its first header tag fails, nothing is ACKed
    monkeypatch.setattr(transfer_bound, "KEY_DATA", b"x" * 32)  # the spawned receiver keeps the module's key
    with pytest.raises((RuntimeError, OSError)):  # no ACK, or the closed connection refuses the next frames
        transfer_bound.run(1, reps=1)
