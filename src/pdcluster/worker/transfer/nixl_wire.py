"""What a STAGED frame carries (pure bytes, no nixl, no torch): where the sender staged one layer's KV in its
NIXL-registered memory, the sender's agent metadata (so the receiver can READ it), and a MAC of the staged
bytes.

Why the MAC: NIXL's data plane (UCX) has no authentication. Anyone who reaches a worker's UCX endpoint and
knows a registered address may write into it, so bytes read over NIXL are untrusted until checked. The
descriptor itself travels in an authenticated frame (the TCP channel's handshake + GMAC tags); the MAC,
keyed from the KV Secret, binds the staged bytes to this request, layer and token range. The receiver
imports nothing whose MAC fails.

MAC = GMAC (AES-256-GCM with the staged bytes as associated data, no plaintext: ~18 GB/s with AES-NI) under
a key derived per request from the Secret and a fresh random salt, with a nonce made of (layer,
token_start, head_start): unique within the request, so no (key, nonce) pair signs two messages (a head
range re-sharded to several decode ranks that replicate it is staged once per route, the same bytes each
time: the same tag, nothing new to learn).

Descriptor layout, big-endian: addr u64, nbytes u64, device u32, salt 16 B, tag 16 B, name_len u16,
meta_len u32, agent name (utf-8), agent metadata; then, only when the bytes lie in several places (a layer
read straight out of the sender's cache blocks, `nixl_direct.py`), count u32 and count × (addr u64, len u64)
in wire order, the first at `addr`, the lengths adding up to `nbytes`. A one-place descriptor is the old one,
byte for byte.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from pdcluster.worker.transfer.frame import MAX_DESCRIPTOR

_FIXED = struct.Struct(">QQI16s16sHI")
_COUNT = struct.Struct(">I")
_SEGMENT = struct.Struct(">QQ")
MAX_SEGMENTS = 512  # runs of blocks of one layer's K and V: a layer's token range in at most this many pieces
_NONCE = struct.Struct(">HIH4x")  # layer, token_start, head_start (0 for a whole layer: the old nonce)
_LABEL = b"pdcluster-nixl-staged-v1\0"
SALT_SIZE = TAG_SIZE = 16

Buffer = bytes | bytearray | memoryview
Segments = tuple[tuple[int, int], ...]


class DescriptorError(ValueError):
    pass


@dataclass(frozen=True)
class Descriptor:
    addr: int  # of the staged bytes in the sender's registered memory
    nbytes: int  # payload then scales, exactly as a LAYER frame would carry them
    device: int
    salt: bytes
    tag: bytes
    agent: str
    metadata: bytes
    segments: Segments = ()  # (addr, len) in wire order when the bytes lie in several places; () = one

    @property
    def parts(self) -> Segments:
        """Where the bytes lie, in wire order."""
        return self.segments or ((self.addr, self.nbytes),)

    def pack(self) -> bytes:
        name = self.agent.encode()
        out = _FIXED.pack(self.addr, self.nbytes, self.device, self.salt, self.tag, len(name),
                          len(self.metadata)) + name + self.metadata
        if len(self.segments) > 1:
            _check_segments(self.addr, self.nbytes, self.segments)
            out += _COUNT.pack(len(self.segments)) + b"".join(_SEGMENT.pack(a, n) for a, n in self.segments)
        if len(out) > MAX_DESCRIPTOR:
            raise DescriptorError(f"descriptor of {len(out)} bytes exceeds {MAX_DESCRIPTOR}")
        return out


def unpack(buf: Buffer) -> Descriptor:
    """Parse a descriptor; every length is checked against the buffer (the frame was authenticated, but a
    parser never trusts a length it has not cross-checked)."""
    if len(buf) < _FIXED.size:
        raise DescriptorError(f"descriptor of {len(buf)} bytes, need at least {_FIXED.size}")
    addr, nbytes, device, salt, tag, name_len, meta_len = _FIXED.unpack_from(buf, 0)
    end = _FIXED.size + name_len + meta_len
    if end > len(buf):
        raise DescriptorError("descriptor lengths do not add up")
    if not name_len or not meta_len:
        raise DescriptorError("descriptor without an agent name or metadata")
    view = memoryview(buf)
    try:
        name = bytes(view[_FIXED.size:_FIXED.size + name_len]).decode()
    except UnicodeDecodeError:
        raise DescriptorError("agent name is not utf-8") from None
    segments: Segments = ()
    if end < len(buf):
        if len(buf) - end < _COUNT.size:
            raise DescriptorError("descriptor lengths do not add up")
        (count,) = _COUNT.unpack_from(buf, end)
        if not 1 < count <= MAX_SEGMENTS or len(buf) - end - _COUNT.size != count * _SEGMENT.size:
            raise DescriptorError(f"descriptor of {count} segments does not add up")
        segments = tuple(_SEGMENT.iter_unpack(view[end + _COUNT.size:]))
        _check_segments(addr, nbytes, segments)
    return Descriptor(addr, nbytes, device, salt, tag, name, bytes(view[_FIXED.size + name_len:end]), segments)


def _check_segments(addr: int, nbytes: int, segments: Segments) -> None:
    if len(segments) > MAX_SEGMENTS or segments[0][0] != addr or any(n <= 0 for _, n in segments) \
            or sum(n for _, n in segments) != nbytes or any(a + n >= 1 << 64 for a, n in segments):
        raise DescriptorError("descriptor segments do not add up to its bytes")


def _key(secret: bytes, salt: bytes, request_id: str) -> bytes:
    return hmac.new(secret, _LABEL + salt + request_id.encode(), hashlib.sha256).digest()


def mac(secret: bytes, salt: bytes, request_id: str, layer: int, token_start: int, data: Buffer | Sequence[Buffer],
        head_start: int = 0) -> bytes:
    """The tag of the staged bytes: one buffer, or several in wire order (the same tag as their join: GCM's
    associated data streams)."""
    key, nonce = _key(secret, salt, request_id), _NONCE.pack(layer, token_start, head_start)
    if isinstance(data, (bytes, bytearray, memoryview)):
        return AESGCM(key).encrypt(nonce, b"", data)
    enc = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
    for part in data:
        enc.authenticate_additional_data(part)
    enc.finalize()
    return enc.tag


def verify(secret: bytes, d: Descriptor, request_id: str, layer: int, token_start: int,
           data: Buffer | Sequence[Buffer], head_start: int = 0) -> bool:
    if len(d.salt) != SALT_SIZE or len(d.tag) != TAG_SIZE:
        return False
    return hmac.compare_digest(mac(secret, d.salt, request_id, layer, token_start, data, head_start), d.tag)
