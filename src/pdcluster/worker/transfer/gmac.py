"""The MAC under every KV frame: GMAC (AES-256-GCM with the data as associated data and no plaintext), keyed per
connection and direction (`handshake.py`), its nonce a label plus the frame's position on the connection.

~18 GB/s with AES-NI/VPCLMULQDQ on one core here, and it releases the GIL; BLAKE3 and Poly1305 are slower per
byte on this hardware (docs/benchmarks.md, KV transfer).
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

_SEQ = struct.Struct(">4sQ")  # the 12-byte GCM nonce: label + sequence number on this connection+direction


Buffer = bytes | bytearray | memoryview


class Gathered:
    """A payload lying in several buffers — K and V of one token range of a layer sent in several frames —
    written scatter-gather and tagged part by part: the wire (and the tag) are those of the joined bytes,
    with no join on the sender."""

    def __init__(self, parts: list[Buffer] | list[memoryview]) -> None:
        self.parts = tuple(memoryview(p).cast("B") for p in parts)

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


class FrameKey:
    """One direction of one authenticated connection: seals (signs) or opens (verifies) frame `seq`.

    Pure: the caller owns the sequence counter, so a reader can verify frame n's body while it already
    reads frame n+1's header."""

    def __init__(self, key: bytes) -> None:
        if len(key) != 32:
            raise ValueError("frame keys are 32 bytes (AES-256)")
        self._key, self._gcm = key, AESGCM(key)

    def tag(self, label: bytes, seq: int, data: Buffer | Gathered) -> bytes:
        if isinstance(data, Gathered):  # the same GMAC, fed part by part (GCM's AAD streams)
            enc = Cipher(algorithms.AES(self._key), modes.GCM(_SEQ.pack(label, seq))).encryptor()
            for part in data.parts:
                enc.authenticate_additional_data(part)
            enc.finalize()
            return enc.tag
        return self._gcm.encrypt(_SEQ.pack(label, seq), b"", data)  # GMAC: no plaintext, data as AAD

    def check(self, label: bytes, seq: int, data: Buffer | Gathered, tag: Buffer) -> bool:
        try:
            if isinstance(data, Gathered):  # fed part by part, as `tag` signs a Gathered payload
                dec = Cipher(algorithms.AES(self._key), modes.GCM(_SEQ.pack(label, seq), bytes(tag))).decryptor()
                for part in data.parts:
                    dec.authenticate_additional_data(part)
                dec.finalize()
            else:
                self._gcm.decrypt(_SEQ.pack(label, seq), bytes(tag), data)
        except InvalidTag:
            return False
        return True
