"""Connection authentication for the KV transport: a mutual challenge-response keyed by the KV Secret, once
per TCP connection, that also derives the connection's two frame keys.

    client -> server   HELLO   b"PDKH" | version | client nonce (32 B)
    server -> client   PROOF   b"PDKH" | version | server nonce (32 B) | HMAC(secret, "server" | nc | ns)
    client -> server   PROOF   HMAC(secret, "client" | nc | ns)

Each side proves it holds the secret over the other's fresh nonce, so a recorded exchange cannot be
replayed, and the two proofs carry different labels, so one cannot be reflected as the other. The frame
keys are HMAC(secret, "c2s"/"s2c" | nc | ns): new for every connection and direction, which is what makes
the per-frame GMAC nonces (label + sequence number) unique and frames from another connection useless.

A server reads exactly 37 + 32 bytes from a peer before it knows whether that peer holds the secret.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass

from pdcluster.worker.transfer.frame import VERSION, ErrorCode, FrameError, FrameKey

MAGIC = b"PDKH"
NONCE = 32
HELLO = struct.Struct(f">4sB{NONCE}s")  # 37 bytes
SERVER_PROOF = struct.Struct(f">4sB{NONCE}s32s")  # 69 bytes
CLIENT_PROOF_SIZE = 32
_LABEL = b"pdkv-v3 "


@dataclass(frozen=True)
class Keys:
    send: FrameKey
    recv: FrameKey


def _mac(secret: bytes, label: bytes, nc: bytes, ns: bytes) -> bytes:
    return hmac.new(secret, _LABEL + label + nc + ns, hashlib.sha256).digest()


def new_nonce() -> bytes:
    return os.urandom(NONCE)


def hello(nc: bytes) -> bytes:
    return HELLO.pack(MAGIC, VERSION, nc)


def parse_hello(buf: bytes | bytearray | memoryview) -> bytes:
    """The client nonce from a HELLO. Raises FrameError (garbage, another protocol, another version)."""
    magic, version, nc = HELLO.unpack(bytes(buf))
    if magic != MAGIC:
        raise FrameError(ErrorCode.BAD_MAGIC, "not a pdcluster KV connection")
    if version != VERSION:
        raise FrameError(ErrorCode.BAD_VERSION, f"peer speaks version {version}, this build {VERSION}")
    return bytes(nc)


def server_proof(secret: bytes, nc: bytes, ns: bytes) -> bytes:
    return SERVER_PROOF.pack(MAGIC, VERSION, ns, _mac(secret, b"server", nc, ns))


def check_server_proof(secret: bytes, nc: bytes, buf: bytes | bytearray | memoryview) -> bytes:
    """The server nonce, once the server has proven it holds the secret. Raises FrameError."""
    magic, version, ns, proof = SERVER_PROOF.unpack(bytes(buf))
    if magic != MAGIC or version != VERSION:
        raise FrameError(ErrorCode.BAD_VERSION, "the transfer port does not speak this KV protocol version")
    if not hmac.compare_digest(proof, _mac(secret, b"server", nc, bytes(ns))):
        raise FrameError(ErrorCode.UNAUTHENTICATED, "the receiver could not prove it holds the KV secret")
    return bytes(ns)


def client_proof(secret: bytes, nc: bytes, ns: bytes) -> bytes:
    return _mac(secret, b"client", nc, ns)


def check_client_proof(secret: bytes, nc: bytes, ns: bytes, proof: bytes | bytearray | memoryview) -> None:
    if not hmac.compare_digest(bytes(proof), _mac(secret, b"client", nc, ns)):
        raise FrameError(ErrorCode.UNAUTHENTICATED, "the sender could not prove it holds the KV secret")


def keys(secret: bytes, nc: bytes, ns: bytes, *, server: bool) -> Keys:
    c2s, s2c = FrameKey(_mac(secret, b"c2s", nc, ns)), FrameKey(_mac(secret, b"s2c", nc, ns))
    return Keys(send=s2c, recv=c2s) if server else Keys(send=c2s, recv=s2c)
