"""`--kv-transfer-integrity fabric` on the TCP backend: payloads go untagged (FLAG_TRUSTED), and only a receiver
that trusts the fabric too accepts them. Everything but the payload stays authenticated: the connection, the
header (so the flag itself), the request id and the scales."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdcluster.worker.transfer import codec
from pdcluster.worker.transfer.connector import LoadSpec, TCPConnector, TransferError, TransferTarget
from pdcluster.worker.transfer.frame import (
    DEFAULT_LIMITS,
    FLAG_TRUSTED,
    HEADER,
    PREAMBLE_SIZE,
    TAG_SIZE,
    ErrorCode,
    Frame,
    FrameError,
    FrameKey,
    Kind,
    decode_frame,
    encode_frame,
    parse_header,
    parse_preamble,
)
from pdcluster.worker.transfer.options import TransferOptions
from tests.transfer.kvsink import Sink
from tests.transfer.test_placing import DIM, HEADS, LAYERS, TOKENS, Cache, kv

KEY = FrameKey(b"i" * 32)
FABRIC = dataclasses.replace(DEFAULT_LIMITS, trust_fabric=True)
SECRET = b"f" * 32


def layer(compression: str = "none") -> Frame:
    return codec.encode_layer("req-f", 1, LAYERS, *kv(1), compression=compression)


def payload_at(frame: Frame) -> int:
    """Offset of the payload in the encoded frame."""
    return PREAMBLE_SIZE + len(frame.request_id) + len(frame.scales)


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_a_fabric_layer_is_flagged_untagged_and_round_trips_at_a_fabric_receiver(compression: str) -> None:
    frame = layer(compression)
    wire = encode_frame(frame, KEY, 5, FABRIC)
    assert parse_header(wire).flags & FLAG_TRUSTED
    assert wire[-TAG_SIZE:] == bytes(TAG_SIZE)  # no payload tag computed
    back = decode_frame(wire, KEY, 5, FABRIC)
    assert bytes(back.payload) == bytes(frame.payload) and bytes(back.scales) == bytes(frame.scales)
    assert back.quantized == frame.quantized


def test_a_mac_receiver_refuses_it_from_the_preamble_alone() -> None:
    wire = encode_frame(layer(), KEY, 0, FABRIC)
    with pytest.raises(FrameError, match="kv-transfer-integrity") as e:
        parse_preamble(wire[:PREAMBLE_SIZE], KEY, 0)  # before a body byte is read
    assert e.value.code == ErrorCode.UNSUPPORTED


def test_the_flag_cannot_be_added_on_the_wire() -> None:
    """A mac sender's frame with the flag set by someone in between fails the header tag: a fabric receiver
    still checks the payloads of senders that tag them."""
    wire = bytearray(encode_frame(layer(), KEY, 0))
    wire[6] |= FLAG_TRUSTED
    with pytest.raises(FrameError) as e:
        decode_frame(bytes(wire), KEY, 0, FABRIC)
    assert e.value.code == ErrorCode.UNAUTHENTICATED


def test_a_fabric_receiver_still_checks_a_tagged_payload() -> None:
    frame = layer()
    wire = bytearray(encode_frame(frame, KEY, 2))  # a mac sender
    assert decode_frame(bytes(wire), KEY, 2, FABRIC).payload == frame.payload
    wire[payload_at(frame) + 3] ^= 1
    with pytest.raises(FrameError) as e:
        decode_frame(bytes(wire), KEY, 2, FABRIC)
    assert e.value.code == ErrorCode.UNAUTHENTICATED


def test_what_fabric_gives_up_and_what_it_keeps() -> None:
    frame = layer("int8")
    wire = bytearray(encode_frame(frame, KEY, 0, FABRIC))
    flipped = bytearray(wire)
    flipped[payload_at(frame) + 3] ^= 1  # the payload: trusted to the fabric, not detected here
    assert bytes(decode_frame(bytes(flipped), KEY, 0, FABRIC).payload) != bytes(frame.payload)
    for offset in (PREAMBLE_SIZE, PREAMBLE_SIZE + len(frame.request_id) + 1, 12):  # request id, scales, header
        bad = bytearray(wire)
        bad[offset] ^= 1
        with pytest.raises(FrameError) as e:
            decode_frame(bytes(bad), KEY, 0, FABRIC)
        assert e.value.code in (ErrorCode.UNAUTHENTICATED, ErrorCode.BAD_HEADER)
    with pytest.raises(FrameError):  # replayed at another position: the header tag binds it
        decode_frame(bytes(wire), KEY, 1, FABRIC)
    junk = bytearray(wire)
    junk[-1] ^= 1  # the payload tag's place must hold zeros, as a fabric sender writes it
    with pytest.raises(FrameError) as e:
        decode_frame(bytes(junk), KEY, 0, FABRIC)
    assert e.value.code == ErrorCode.UNAUTHENTICATED


@pytest.mark.parametrize("kind", [Kind.ACK, Kind.ABORT, Kind.STAGED])
def test_only_layer_frames_may_carry_the_flag(kind: Kind) -> None:
    shape = dict(layer=0, num_layers=1, token_end=1, kv_heads=1, head_dim=1, payload=b"d" * 8)
    frame = Frame(kind=kind, request_id="r", **shape) if kind == Kind.STAGED else Frame(kind=kind, request_id="r")
    wire = encode_frame(frame, KEY, 0, FABRIC)
    assert not parse_header(wire).flags & FLAG_TRUSTED  # a fabric sender flags LAYER frames only
    head = bytearray(wire[:HEADER.size])
    head[6] |= FLAG_TRUSTED
    with pytest.raises(FrameError, match="untagged"):
        parse_header(bytes(head))


async def transfer(send_integrity: str, recv_integrity: str, compression: str = "none",
                   placed: bool = False) -> tuple[Sink, Cache, str, int]:
    """One request of LAYERS layers between two connectors, both closed after: what the receiver imported
    (sink) or placed (cache), "ok" or the sender's error, and the frames the receiver rejected."""
    sink, cache = Sink(), Cache()
    recv = TCPConnector(SECRET, TransferOptions(integrity=recv_integrity), importer=sink,
                        destination=cache.destination if placed else None)
    send = TCPConnector(SECRET, TransferOptions(compression=compression, integrity=send_integrity, max_retries=0,
                                                timeout_s=5))
    try:
        port = await recv.listen()
        recv.start_load_kv(LoadSpec("r", LAYERS, TOKENS, HEADS, DIM))
        send.start_save("r", TransferTarget("127.0.0.1", port), LAYERS)
        for i in range(LAYERS):
            send.save_kv_layer("r", i, *kv(i))
        try:
            await send.wait_for_save("r")
            await recv.wait_for_load("r", timeout=5)
            outcome = "ok"
        except TransferError as e:
            outcome = str(e)
        return sink, cache, outcome, recv.stats.frames_rejected
    finally:
        await send.close()
        await recv.close()


@pytest.mark.parametrize("compression,placed", [("none", False), ("none", True), ("int8", False)])
async def test_fabric_to_fabric_moves_every_layer_exactly(compression: str, placed: bool) -> None:
    sink, cache, outcome, _ = await transfer("fabric", "fabric", compression, placed)
    assert outcome == "ok"
    for i in range(LAYERS):
        k, v = cache.kv[i] if placed else sink[("r", i)]
        tol = 0.05 if compression == "int8" else 0.0
        assert torch.allclose(k, kv(i)[0], atol=tol) and torch.allclose(v, kv(i)[1], atol=tol)


async def test_a_mac_sender_is_served_by_a_fabric_receiver() -> None:
    sink, _, outcome, _ = await transfer("mac", "fabric")
    assert outcome == "ok" and torch.equal(sink[("r", 2)][0], kv(2)[0])


async def test_a_fabric_sender_fails_at_a_mac_receiver_naming_the_flag() -> None:
    sink, _, outcome, rejected = await transfer("fabric", "mac")
    assert "kv-transfer-integrity" in outcome and "UNSUPPORTED" in outcome
    assert len(sink) == 0  # nothing imported
    assert rejected >= 1


def test_an_unknown_integrity_is_refused() -> None:
    with pytest.raises(ValueError, match="integrity"):
        TCPConnector(SECRET, TransferOptions(integrity="none"))
