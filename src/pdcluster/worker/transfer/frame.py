"""KV transfer wire format (version 3): a fixed header, a request id, optional int8 scales, the payload.

This module is pure bytes-in/bytes-out (no torch, no sockets) so that the strict parser can be fuzzed
cheaply and reused by any transport.

Authentication is per connection, not per frame: `handshake.py` proves both ends hold the KV Secret
(mutual challenge-response) and derives one fresh AES-256 key per direction. Every frame is then bound to
its connection, direction and position by a 16-byte GMAC (AES-GCM with the frame as associated data and no
plaintext: ~18 GB/s with AES-NI/PCLMUL here, against 0.7 GB/s for the HMAC-SHA256 + crc32 of version 2).
The nonce is a label plus the frame's sequence number on that connection, never sent: a replayed,
reordered, dropped or foreign frame fails its tag, and a tag never needs a crc beside it.

Frame layout — all integers big-endian::

    offset size  field
    0      4     magic            b"PDKV"
    4      1     version          3 (2 had per-frame HMAC-SHA256 + crc32, 1 no header MAC); 4 = a data
                                  frame of a head range starting at a nonzero global KV head (below)
    5      1     kind             1 = LAYER (KV for one layer), 2 = ACK (receiver -> sender),
                                  3 = ABORT (sender gives up; receiver drops the partial import),
                                  4 = STAGED (the layer lies in the sender's NIXL-registered staging
                                  memory; the payload is a descriptor, `nixl_wire.py`, and the
                                  receiver READs the bytes itself, then checks their MAC)
    6      1     flags            bit 0: payload is cache codes (int8, or int4 packed two per byte) with
                                  per-vector float32 scales; bit 1 (LAYER only): the payload is not tagged
                                  (payload_tag is zeros), the sender trusts the fabric
                                  (`--kv-transfer-integrity fabric`); a receiver that does not refuses it
    7      1     dtype            1 f32, 2 f16, 3 bf16, 4 int8, 5 int4 (uint8 bytes, low nibble = even
                                  index: [tokens, kv_heads, head_dim / 2] each, head_dim even)
    8      2     request_id_len   1..128
    10     2     layer            index of this layer
    12     2     num_layers       total layers the receiver must expect
    14     4     token_start      first token position covered (chunked transfers)
    18     4     token_end        one past the last token position
    22     2     kv_heads
    24     2     head_dim
    26     2     status           ACK only: 0 ok, else an ErrorCode; 0 for other kinds in version 3.
                                  head_start in version 4 (LAYER/STAGED only): the global index of the
                                  frame's first KV head (re-sharding between TP layouts, `reshard.py`);
                                  a frame starting at head 0 stays version 3, byte for byte as before
    28     4     scales_len       bytes of float32 scales (K then V, [num_tokens, kv_heads] each)
    32     4     payload_len      bytes of K then V, each [num_tokens, kv_heads, head_dim] of `dtype`
    36     16    header_tag       GMAC(key, nonce "hdr" + seq, bytes 0..36)
    52     ...   request_id       utf-8
    ...    ...   scales
    ...    ...   payload
    end-32 16    meta_tag         GMAC(key, nonce "met" + seq, request_id + scales)
    end-16 16    payload_tag      GMAC(key, nonce "pay" + seq, payload)   (two tags: GCM signs one
                                  contiguous buffer, and the payload is sent from where it lies)

The header is validated completely — lengths against limits and against the shape the header itself
declares — and its tag is checked before a single body byte is read: a reader never trusts a length it
has not cross-checked, and a peer that is not authenticated never gets a body buffer at all.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

from pdcluster.worker.transfer.gmac import Buffer, FrameKey, Gathered

MAGIC = b"PDKV"
VERSION = 3
VERSION_HEADS = 4  # a LAYER/STAGED frame whose heads start at a nonzero global head (bytes 26..27)
HEADER = struct.Struct(">4sBBBBHHHIIHHHII")
HEADER_SIZE = HEADER.size  # 36
TAG_SIZE = 16
PREAMBLE_SIZE = HEADER_SIZE + TAG_SIZE  # 52: all a reader takes for a frame before its header is authenticated
TRAILER_SIZE = 2 * TAG_SIZE
MAX_REQUEST_ID = 128
MAX_DESCRIPTOR = 64 * 1024  # a STAGED frame's payload: addresses, segments, MAC and the sender's agent metadata (0.5 KiB + ~44 B per registered cache pool)
FLAG_QUANT = 0x01  # codes + per-vector float32 scales (int8 or packed int4), as a quantized cache holds them
FLAG_INT8 = FLAG_QUANT  # its name before int4 codes travelled too
FLAG_TRUSTED = 0x02  # the payload carries no tag: its integrity is the fabric's (mTLS/IPsec/WireGuard, RDMA)
KNOWN_FLAGS = FLAG_QUANT | FLAG_TRUSTED


class Kind(IntEnum):
    LAYER = 1
    ACK = 2
    ABORT = 3
    STAGED = 4


class DType(IntEnum):
    F32 = 1
    F16 = 2
    BF16 = 3
    I8 = 4
    I4 = 5  # packed two per byte: a vector of head_dim values is head_dim / 2 bytes


ITEMSIZE = {DType.F32: 4, DType.F16: 2, DType.BF16: 2, DType.I8: 1, DType.I4: 1}
QUANTIZED = (DType.I8, DType.I4)


def vector_bytes(dtype: DType, dim: int) -> int:
    """Bytes of one [head_dim] vector on the wire (int4: two values per byte)."""
    return dim // 2 if dtype == DType.I4 else dim * ITEMSIZE[dtype]


class ErrorCode(IntEnum):
    """Status carried by an ACK; also the reason a FrameError was raised."""

    OK = 0
    BAD_MAGIC = 1
    BAD_VERSION = 2
    BAD_HEADER = 3
    TOO_LARGE = 4
    TRUNCATED = 5
    CHECKSUM = 6
    UNAUTHENTICATED = 7
    UNKNOWN_REQUEST = 8  # no reservation for this request id (expired, cancelled, never made)
    SHAPE_MISMATCH = 9  # frame does not fit the receiver's model (layers, heads, head_dim, tokens)
    INTERNAL = 10
    UNSUPPORTED = 11  # a STAGED frame at a receiver without NIXL (the two sides run different backends)


class FrameError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


@dataclass(frozen=True)
class Limits:
    """Upper bounds enforced before allocation. Defaults fit a 70B layer of a 32k-token prompt in fp16
    (2 * 32768 * 8 heads * 128 * 2 B = 128 MiB) — larger prompts are split into token ranges."""

    max_frame_bytes: int = 256 * 1024 * 1024
    max_tokens: int = 1 << 20
    max_kv_heads: int = 1024
    max_head_dim: int = 1024
    max_layers: int = 4096
    # not a bound but what this side accepts and sends: layers whose payload goes untagged (FLAG_TRUSTED)
    trust_fabric: bool = False


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Frame:
    kind: Kind
    request_id: str
    layer: int = 0
    num_layers: int = 0
    token_start: int = 0
    token_end: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    dtype: DType = DType.F32
    flags: int = 0
    status: int = 0
    head_start: int = 0  # global index of the first KV head carried (TP re-sharding); 0 = from the first
    scales: bytes | memoryview = b""  # parsed frames hold zero-copy views into the received buffer
    payload: bytes | memoryview | Gathered = b""  # Gathered: sent scatter-gather, or received in place
    placed: bool = False  # receiver: the payload was received straight into its destination (parse_placed)
    held: Callable[[], bool] | None = None  # sender: False once the memory the payload views is taken back

    @property
    def num_tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def quantized(self) -> bool:
        return bool(self.flags & FLAG_QUANT)


@dataclass(frozen=True)
class Header:
    kind: Kind
    flags: int
    dtype: DType
    request_id_len: int
    layer: int
    num_layers: int
    token_start: int
    token_end: int
    kv_heads: int
    head_dim: int
    status: int
    scales_len: int
    payload_len: int
    head_start: int = 0

    @property
    def body_len(self) -> int:
        """Bytes that follow the preamble: request id, scales, payload, body tag."""
        return self.request_id_len + self.scales_len + self.payload_len + TRAILER_SIZE


def expected_lengths(kind: Kind, flags: int, dtype: DType, tokens: int, heads: int, dim: int) -> tuple[int, int]:
    """(scales_len, payload_len) a well-formed frame must declare; the parser accepts nothing else."""
    if kind != Kind.LAYER:
        return 0, 0  # STAGED: the descriptor's length varies (checked by parse_header)
    vectors = tokens * heads
    return (2 * vectors * 4 if flags & FLAG_QUANT else 0), 2 * vectors * vector_bytes(dtype, dim)


def parse_header(buf: Buffer, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Validate the fixed 36-byte header. Raises FrameError; never allocates beyond `buf`."""
    if len(buf) < HEADER_SIZE:
        raise FrameError(ErrorCode.TRUNCATED, f"header is {len(buf)} bytes, need {HEADER_SIZE}")
    (magic, version, kind, flags, dtype, rid_len, layer, num_layers, t0, t1, heads, dim, status,
     scales_len, payload_len) = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FrameError(ErrorCode.BAD_MAGIC, "not a pdcluster KV frame")
    if version not in (VERSION, VERSION_HEADS):
        raise FrameError(ErrorCode.BAD_VERSION, f"version {version}, this build speaks {VERSION} and {VERSION_HEADS}")
    try:
        kind_e, dtype_e = Kind(kind), DType(dtype)
    except ValueError as e:
        raise FrameError(ErrorCode.BAD_HEADER, str(e)) from None
    if flags & ~KNOWN_FLAGS:
        raise FrameError(ErrorCode.BAD_HEADER, f"unknown flags {flags:#x}")
    if not 0 < rid_len <= MAX_REQUEST_ID:
        raise FrameError(ErrorCode.BAD_HEADER, f"request id length {rid_len}")
    if t1 < t0 or t1 - t0 > limits.max_tokens:
        raise FrameError(ErrorCode.BAD_HEADER, f"token range [{t0}, {t1})")
    if heads > limits.max_kv_heads or dim > limits.max_head_dim or num_layers > limits.max_layers:
        raise FrameError(ErrorCode.BAD_HEADER, "shape exceeds limits")
    if kind_e in (Kind.LAYER, Kind.STAGED):
        if not (layer < num_layers and heads > 0 and dim > 0 and t1 > t0):
            raise FrameError(ErrorCode.BAD_HEADER, "layer frame with empty shape or layer out of range")
        if bool(flags & FLAG_QUANT) != (dtype_e in QUANTIZED):
            raise FrameError(ErrorCode.BAD_HEADER, "quantized flag and dtype disagree")
        if dtype_e == DType.I4 and dim % 2:
            raise FrameError(ErrorCode.BAD_HEADER, f"int4 codes need an even head_dim, got {dim}")
    if flags & FLAG_TRUSTED and kind_e != Kind.LAYER:
        raise FrameError(ErrorCode.BAD_HEADER, f"an untagged payload on a {kind_e.name} frame")
    head_start = 0
    if version == VERSION_HEADS:  # bytes 26..27 are the data frame's first global KV head
        if kind_e not in (Kind.LAYER, Kind.STAGED):
            raise FrameError(ErrorCode.BAD_HEADER, f"version {VERSION_HEADS} is for LAYER/STAGED frames only")
        head_start, status = status, 0
        if head_start + heads > limits.max_kv_heads:
            raise FrameError(ErrorCode.BAD_HEADER, f"heads [{head_start}, +{heads}) exceed limits")
    if kind_e != Kind.ACK and status != 0:
        raise FrameError(ErrorCode.BAD_HEADER, "status is only meaningful on ACK")
    want_scales, want_payload = expected_lengths(kind_e, flags, dtype_e, t1 - t0, heads, dim)
    if kind_e == Kind.STAGED:
        if scales_len != 0 or not 0 < payload_len <= MAX_DESCRIPTOR:
            raise FrameError(ErrorCode.BAD_HEADER, f"staged descriptor of {scales_len}/{payload_len} bytes")
    elif (scales_len, payload_len) != (want_scales, want_payload):
        raise FrameError(ErrorCode.BAD_HEADER, f"lengths {scales_len}/{payload_len} do not match the shape")
    hdr = Header(kind_e, flags, dtype_e, rid_len, layer, num_layers, t0, t1, heads, dim, status,
                 scales_len, payload_len, head_start)
    if HEADER_SIZE + hdr.body_len > limits.max_frame_bytes:
        raise FrameError(ErrorCode.TOO_LARGE, f"frame of {HEADER_SIZE + hdr.body_len} bytes")
    return hdr


_HDR, _MET, _PAY = b"hdr\0", b"met\0", b"pay\0"


def parse_preamble(buf: Buffer, key: FrameKey, seq: int, limits: Limits = DEFAULT_LIMITS) -> Header:
    """Validate the header and authenticate it (its tag, for position `seq`) from the first PREAMBLE_SIZE
    bytes: only then may a reader accept the body the header announces."""
    hdr = parse_header(buf, limits)
    if len(buf) < PREAMBLE_SIZE:
        raise FrameError(ErrorCode.TRUNCATED, f"preamble is {len(buf)} bytes, need {PREAMBLE_SIZE}")
    view = memoryview(buf)
    if not key.check(_HDR, seq, view[:HEADER_SIZE], view[HEADER_SIZE:PREAMBLE_SIZE]):
        raise FrameError(ErrorCode.UNAUTHENTICATED, "header tag mismatch (wrong secret, replayed or reordered frame)")
    if hdr.flags & FLAG_TRUSTED and not limits.trust_fabric:  # refused before a body byte is read
        raise FrameError(ErrorCode.UNSUPPORTED, "the sender tags no payload (--kv-transfer-integrity fabric) and this "
                                                "receiver checks every byte (mac): run both sides alike")
    return hdr


def _payload_ok(hdr: Header, key: FrameKey, seq: int, payload: Buffer | Gathered, tag: Buffer) -> bool:
    """The payload's tag holds, or the (authenticated) header says there is none (parse_preamble decided that
    this receiver accepts that) and its place holds the zeros a sender writes there."""
    if hdr.flags & FLAG_TRUSTED:
        return bytes(tag) == bytes(TAG_SIZE)
    return key.check(_PAY, seq, payload, tag)


def parse_body(hdr: Header, body: Buffer, key: FrameKey, seq: int) -> Frame:
    """Check the body tag, then split the body (exactly hdr.body_len bytes). The returned frame's
    scales/payload are zero-copy views into `body`."""
    if len(body) != hdr.body_len:
        raise FrameError(ErrorCode.TRUNCATED, f"body is {len(body)} bytes, header says {hdr.body_len}")
    view = memoryview(body)
    rid_end = hdr.request_id_len
    scales_end = rid_end + hdr.scales_len
    signed_end = len(body) - TRAILER_SIZE
    if not (key.check(_MET, seq, view[:scales_end], view[signed_end:signed_end + TAG_SIZE])
            and _payload_ok(hdr, key, seq, view[scales_end:signed_end], view[signed_end + TAG_SIZE:])):
        raise FrameError(ErrorCode.UNAUTHENTICATED, "body tag mismatch (tampered, replayed or wrong secret)")
    return _checked_frame(hdr, view[:rid_end], view[rid_end:scales_end], view[scales_end:signed_end])


def parse_placed(hdr: Header, meta: Buffer, parts: list[memoryview], tags: Buffer, key: FrameKey, seq: int) -> Frame:
    """A body received in pieces: `meta` (request id + scales), the payload straight into its destination
    `parts` (in wire order), then the two tags. Checked exactly as `parse_body` checks a body in one buffer
    (the same bytes, the same tags); the frame's payload is `parts` (`placed`)."""
    if len(meta) != hdr.request_id_len + hdr.scales_len or len(tags) != TRAILER_SIZE \
            or sum(len(p) for p in parts) != hdr.payload_len:
        raise FrameError(ErrorCode.TRUNCATED, "placed body does not match its header's lengths")
    payload = Gathered(parts)
    tag_view = memoryview(tags)
    if not (key.check(_MET, seq, meta, tag_view[:TAG_SIZE]) and _payload_ok(hdr, key, seq, payload, tag_view[TAG_SIZE:])):
        raise FrameError(ErrorCode.UNAUTHENTICATED, "body tag mismatch (tampered, replayed or wrong secret)")
    view = memoryview(meta)
    return _checked_frame(hdr, view[:hdr.request_id_len], view[hdr.request_id_len:], payload, placed=True)


def _checked_frame(hdr: Header, request_id: memoryview, scales: memoryview, payload: memoryview | Gathered,
                   placed: bool = False) -> Frame:
    """The frame of an authenticated body (its tags already checked): the header's fields and its parts."""
    try:
        rid = bytes(request_id).decode("utf-8")
    except UnicodeDecodeError:
        raise FrameError(ErrorCode.BAD_HEADER, "request id is not utf-8") from None
    return Frame(
        kind=hdr.kind, request_id=rid, layer=hdr.layer, num_layers=hdr.num_layers,
        token_start=hdr.token_start, token_end=hdr.token_end, kv_heads=hdr.kv_heads,
        head_dim=hdr.head_dim, dtype=hdr.dtype, flags=hdr.flags, status=hdr.status,
        head_start=hdr.head_start, scales=scales, payload=payload, placed=placed,
    )


def seal_frame(frame: Frame, key: FrameKey, seq: int, limits: Limits = DEFAULT_LIMITS) -> list[Buffer]:
    """The frame as buffers to send in order (scatter-gather: the payload is never copied). Validates with
    the parser's rules, so we never emit what a receiver would refuse. With `limits.trust_fabric` a LAYER's
    payload goes untagged (FLAG_TRUSTED): the one pass over its bytes before the socket copy is skipped."""
    rid = frame.request_id.encode("utf-8")
    trusted = limits.trust_fabric and frame.kind == Kind.LAYER
    flags = frame.flags | FLAG_TRUSTED if trusted else frame.flags & ~FLAG_TRUSTED
    head = HEADER.pack(
        MAGIC, VERSION_HEADS if frame.head_start else VERSION, int(frame.kind), flags, int(frame.dtype),
        len(rid), frame.layer, frame.num_layers, frame.token_start, frame.token_end, frame.kv_heads, frame.head_dim,
        frame.head_start or frame.status, len(frame.scales), len(frame.payload),
    )
    parse_header(head, limits)  # raises on anything a receiver would refuse
    meta = rid + bytes(frame.scales)  # small next to the payload (int8 scales: 4 / head_dim of it)
    body = list(frame.payload.parts) if isinstance(frame.payload, Gathered) else [frame.payload]
    return [head + key.tag(_HDR, seq, head), meta, *body,
            key.tag(_MET, seq, meta) + (bytes(TAG_SIZE) if trusted else key.tag(_PAY, seq, frame.payload))]


def encode_frame(frame: Frame, key: FrameKey, seq: int = 0, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """One frame as bytes (tests, fuzzing)."""
    return b"".join(seal_frame(frame, key, seq, limits))


def decode_frame(buf: Buffer, key: FrameKey, seq: int = 0, limits: Limits = DEFAULT_LIMITS) -> Frame:
    """Parse one complete frame held in memory (tests, fuzzing). Trailing bytes are an error."""
    hdr = parse_preamble(buf, key, seq, limits)
    body = memoryview(buf)[PREAMBLE_SIZE:]
    if len(body) < hdr.body_len:
        raise FrameError(ErrorCode.TRUNCATED, f"have {len(body)} body bytes, need {hdr.body_len}")
    if len(body) > hdr.body_len:
        raise FrameError(ErrorCode.BAD_HEADER, "trailing bytes after frame")
    return parse_body(hdr, bytearray(body), key, seq)


def ack(request_id: str, layer: int, status: ErrorCode = ErrorCode.OK) -> Frame:
    return Frame(kind=Kind.ACK, request_id=request_id, layer=layer, status=int(status))
