"""The frame-loop ceiling bench runs the transport's frame code end to end between two processes."""

import pytest

from pdcluster.bench import transfer_bound


@pytest.mark.parametrize("ack_each", [True, False])
def test_a_request_of_frames_is_sealed_sent_checked_and_acknowledged(ack_each: bool) -> None:
    # the receiver verifies every frame's tags (parse_placed raises otherwise) and the sender waits for the ACKs
    # it expects: a frame-format change that breaks either side fails or hangs here, not in a benchmark run
    r = transfer_bound.run(1, reps=1, ack_each=ack_each)
    assert r["layers"] == 32 and r["ack"] == ("each" if ack_each else "last")
    assert r["raw"] > 0 and r["frames"] > 0 and r["paired"] > 0


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
