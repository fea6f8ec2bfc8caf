"""The NIXL transfer backend: KV bytes move over NIXL (UCX: RDMA, NVLink, shared memory, TCP), while what
the bytes mean, and whether to trust them, travels over the authenticated TCP channel of the TCP backend.

Producer (prefill), per layer as the engine writes it (layer-wise, overlapped with the next layer's
compute): the layer is encoded as the wire carries it (int8 codes + scales when compression is int8, the
codec's quantization) straight into a region of the agent's staging buffer, registered once at start.
A STAGED frame then goes over the authenticated channel: where the bytes lie, this agent's metadata, and a
MAC of the bytes (`nixl_wire.py`). The region is freed when the receiver ACKs that frame, and every region
of a request when it ends in any way (done, abort, timeout, decode death). A layer that finds no free
staging region goes as an ordinary LAYER frame instead (never blocks the engine, never deadlocks).

Consumer (decode), on a STAGED frame: adds the sender's agent (cached by name), READs the bytes into a
region of its own staging buffer, checks their MAC (NIXL's data plane has no authentication), decodes
them with the codec, frees the region and imports the layer: the same path as a LAYER frame from there on.
A failed READ forgets the peer's agent (it may have died or restarted) and is retried by the sender.

Why the receiver reads instead of the sender writing: the descriptors then travel inside the transfer
channel that is already authenticated per frame, the decode worker never exposes per-request addresses in
an HTTP answer, and the router stays out of it (it only ever forwards host and port). vLLM's NixlConnector
pulls the same way (decode READs from the prefill side).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from pdcluster.kernels import native
from pdcluster.worker.transfer import chunking, codec, handoff, nixl_direct, nixl_wire, views
from pdcluster.worker.transfer.channel import TransferError
from pdcluster.worker.transfer.connector import INLINE_MAX, Received, SaveResult, TCPConnector, TransferTarget
from pdcluster.worker.transfer.frame import DType, ErrorCode, Frame, Kind, expected_lengths
from pdcluster.worker.transfer.gmac import Gathered
from pdcluster.worker.transfer.head_slice import Fanout, HeadRoute
from pdcluster.worker.transfer.nixl_agent import Agent
from pdcluster.worker.transfer.options import TransferOptions
from pdcluster.worker.transfer.staging import Staging

log = logging.getLogger(__name__)

DEFAULT_STAGING_BYTES = 256 * 1024 * 1024
MAX_REMOTES = 64  # peer agents kept added; the least recently used one is removed beyond this


def _descriptor(frame: Frame) -> nixl_wire.Descriptor:
    """A STAGED frame's descriptor: its payload, one small buffer (joined should it ever come in parts)."""
    payload = frame.payload
    return nixl_wire.unpack(bytes(payload) if isinstance(payload, Gathered) else payload)


@dataclass
class _Outgoing:
    salt: bytes = field(default_factory=lambda: os.urandom(nixl_wire.SALT_SIZE))
    regions: set[int] = field(default_factory=set)  # staging offsets of frames not yet acknowledged
    staged_bytes: int = 0
    descriptor_bytes: int = 0


class NixlConnector(nixl_direct.DirectPath, TCPConnector):
    """KV over NIXL, described and authenticated over the TCP backend's channel (LAYER frames still work)."""

    _streams = False  # a layer is staged whole (one region, one descriptor)
    _sends_views = False  # layers go through the registered staging buffer, never straight from the cache

    def __init__(self, secret: bytes, options: TransferOptions, *, staging_bytes: int = DEFAULT_STAGING_BYTES,
                 agent_name: str | None = None, **kw: Any) -> None:
        # options.integrity mac: the bytes read over NIXL are MAC-checked before import (NIXL's data plane is
        # not authenticated); fabric: trusted as they land, as vLLM's and Dynamo's connectors do (an isolated
        # RDMA/NVLink fabric), and so are the payloads of layers that go over the channel (TCPConnector)
        super().__init__(secret, options, **kw)
        self.agent = Agent(agent_name or f"pdkv-{uuid.uuid4().hex[:12]}", staging_bytes)
        self.staging = Staging(staging_bytes)
        self._metadata = self.agent.metadata()
        self._out: dict[str, _Outgoing] = {}
        self._out_lock = threading.Lock()  # encoder threads stage while the loop frees
        self._remotes: OrderedDict[str, bytes] = OrderedDict()  # agent name -> metadata it was added with
        self._remote_lock = threading.RLock()  # reads run on several threads at once
        self.fallback_layers = 0  # layers that went over TCP because staging was full
        self.direct_layers = [0, 0]  # layers sent / received cache to cache (no staging on that side)
        self._lent: dict[int, tuple[int, int]] = {}  # address -> (offset, bytes) lent to the engine's export
        self.direct = False  # the engine's cache is registered: float layers go cache to cache (nixl_direct.py)
        self._inflight = nixl_direct.Inflight()
        self._readers = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="kv-nixl-read")  # big READs

    async def close(self) -> None:
        await super().close()
        for rid in list(self._out):
            self._release(rid)
        for name in list(self._remotes):
            self._forget(name)
        self._readers.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.agent.close)

    def registrations(self) -> dict[str, int]:
        """What this connector holds in NIXL: leak checks read this after requests end."""
        return {"registered": int(self.agent.registered), "staging_regions": self.staging.regions,
                "staging_used_bytes": self.staging.used, "remote_agents": self.agent.remote_count,
                "outgoing": len(self._out), "reads_in_flight": self._inflight.count(),
                "direct_sent": self.direct_layers[0], "direct_received": self.direct_layers[1]}

    # ------------------------------------------------------------------ producer
    def start_save(self, request_id: str, target: TransferTarget, num_layers: int) -> None:
        super().start_save(request_id, target, num_layers)
        with self._out_lock:
            self._out[request_id] = _Outgoing()
        self._outboxes[request_id][0].on_ack = self._acked

    def start_save_heads(self, request_id: str, routes: list[HeadRoute], num_layers: int) -> None:
        super().start_save_heads(request_id, routes, num_layers)
        with self._out_lock:
            self._out[request_id] = _Outgoing()
        fan = self._outboxes[request_id][0]
        fan.on_ack = self._acked
        if isinstance(fan, Fanout):  # head ranges cut out of a lent export are copies: the region comes back
            fan.release = self._dropped

    def export_buffer(self, request_id: str, layer: int, token_start: int, nbytes: int,
                      quantized: bool) -> torch.Tensor | None:
        """Engine thread: a staging region for the engine to gather this layer's range into, so the bytes sit
        in registered memory with no copy of ours. None when we would transform them anyway (int8 compression
        of a float layer), when staging is full, or for a request we do not send."""
        if self.compression == "int8" and not quantized:
            return None
        with self._out_lock:
            if request_id not in self._out:
                return None
        off = self.staging.alloc(nbytes)
        if off is None:
            return None
        buf = self.agent.buffer[off:off + nbytes]
        with self._out_lock:
            self._lent[int(buf.data_ptr())] = (off, nbytes)
        return buf

    def save_kv_views(self, request_id: str, layer: int, parts: list[memoryview], *, token_start: int,
                      num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      held: Callable[[], bool] | None = None) -> bool:
        """Engine thread: int8 compression quantizes the layer from where it lies (`_save_quantized`); a float
        layer goes cache to cache (`nixl_direct.DirectPath.save_kv_views`)."""
        entry = self._outboxes.get(request_id)
        if self.compression == "int8" and entry is not None and self._loop is not None \
                and not isinstance(entry[0], Fanout):
            return self._save_quantized(request_id, layer, entry[1], entry[0], parts, token_start=token_start,
                                        num_tokens=num_tokens, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        return super().save_kv_views(request_id, layer, parts, token_start=token_start, num_tokens=num_tokens,
                                     kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, held=held)

    def _save_quantized(self, request_id: str, layer: int, num_layers: int, box: Any, parts: list[memoryview], *,
                        token_start: int, num_tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        """Engine thread, int8 compression of a float layer lying in `parts`: quantized where it lies, piece
        by piece (chunking.PIPE_BYTES on the wire each, as the TCP path's views.quantized_frames), each piece's
        codes and scales staged and described at once, so that the receiver READs and imports piece n while
        piece n+1 is quantized. False (gather it for save_kv_layer) without the native quantizer: the torch
        one is ~14x slower and belongs on an encoder thread."""
        if dtype != torch.float32 or not native.quant_ready():
            return False
        loop = self._loop
        assert loop is not None
        for s, e, pieces in views.quantized_runs(parts, num_tokens, kv_heads, head_dim, chunking.PIPE_BYTES):
            n = e - s
            codes = torch.cat([q.reshape(-1) for q, _ in pieces]).view(2, n, kv_heads, head_dim)
            scales = torch.cat([sc.reshape(-1) for _, sc in pieces]).view(2, n, kv_heads)
            frames = self._frames(request_id, layer, num_layers, codes[0], codes[1], token_start + s,
                                  (scales[0], scales[1]))

            def put(frames: list[Frame] = frames) -> None:  # on the loop; dropped once the save has ended
                if request_id in self._outboxes:
                    for f in frames:
                        box.put(f)

            put() if handoff.on_loop(loop) else loop.call_soon_threadsafe(put)
        return True

    def _take_lent(self, k: torch.Tensor) -> tuple[int, int] | None:
        """The lent region this save's tensors lie in (K is its first byte), handed back by the engine."""
        with self._out_lock:
            return self._lent.pop(int(k.data_ptr()), None)

    def _dropped(self, k: torch.Tensor) -> None:
        lent = self._take_lent(k)
        if lent is not None:
            self.staging.free(lent[0])

    def _frames(self, request_id: str, layer: int, num_layers: int, k: torch.Tensor, v: torch.Tensor,
                offset: int, scales: codec.Scales | None = None, head_start: int = 0) -> list[Frame]:
        """Encoder thread: describe one layer's token range where it lies in staging (the engine gathered it
        there: no copy), else stage it (one copy, or the int8 quantization's output); TCP frames when staging
        is full."""
        lent = self._take_lent(k)
        try:
            dtype, flags, payload, wire_scales = codec.wire_tensors(k, v, self.compression, scales)
        except BaseException:
            if lent is not None:
                self.staging.free(lent[0])
            raise
        if lent is not None and lent[1] != sum(t.numel() * t.element_size() for t in payload + wire_scales):
            self.staging.free(lent[0])  # not what the wire carries after all (never with the engine's export)
            lent = None
        if lent is not None:
            off, nbytes = lent
        else:
            flat = [t.contiguous().reshape(-1).view(torch.uint8) for t in payload + wire_scales]
            nbytes = sum(int(b.numel()) for b in flat)
            got = self.staging.alloc(nbytes) if nbytes <= self.staging.size else None
            if got is None:
                self.fallback_layers += 1
                log.info("kv transfer %s: no free staging for layer %d (%d bytes): sent over TCP", request_id,
                         layer, nbytes)
                return super()._frames(request_id, layer, num_layers, k, v, offset, scales, head_start)
            off = got
        keep = False
        try:
            if lent is None:
                pos = off
                for b in flat:
                    self.agent.buffer[pos:pos + b.numel()].copy_(b)
                    pos += int(b.numel())
            with self._out_lock:
                out = self._out.get(request_id)
            if out is None:
                return []  # aborted meanwhile: nothing will be sent
            tag = self._tag(out.salt, request_id, layer, offset, self._view(off, nbytes), head_start)
            desc = nixl_wire.Descriptor(self.agent.base + off, nbytes, 0, out.salt, tag, self.agent.name,
                                        self._metadata).pack()
            with self._out_lock:
                if self._out.get(request_id) is not out:
                    return []
                out.regions.add(off)
                out.staged_bytes += nbytes
                out.descriptor_bytes += len(desc)
                keep = True
        finally:
            if not keep:
                self.staging.free(off)
        tokens, heads = k.shape[:2]
        dim = k.shape[2] * 2 if dtype == DType.I4 else k.shape[2]
        return [Frame(kind=Kind.STAGED, request_id=request_id, layer=layer, num_layers=num_layers,
                      token_start=offset, token_end=offset + tokens, kv_heads=heads, head_dim=dim,
                      dtype=dtype, flags=flags, payload=desc, head_start=head_start)]

    def _view(self, off: int, nbytes: int) -> memoryview:
        return self.agent.buffer[off:off + nbytes].numpy().data

    def _acked(self, frame: Frame) -> None:
        """The receiver has read and checked this layer: its region can be reused."""
        if frame.kind != Kind.STAGED:
            return
        off = _descriptor(frame).addr - self.agent.base  # our own descriptor: where it lies
        with self._out_lock:
            out = self._out.get(frame.request_id)
            if out is None or off not in out.regions:
                return
            out.regions.discard(off)
        self.staging.free(off)

    def _release(self, request_id: str) -> _Outgoing | None:
        with self._out_lock:
            out = self._out.pop(request_id, None)
        if out is not None:
            for off in out.regions:
                self.staging.free(off)
            out.regions.clear()
        return out

    async def wait_for_save(self, request_id: str) -> SaveResult:
        try:
            res = await super().wait_for_save(request_id)
        finally:
            out = self._release(request_id)
        moved = res.bytes + (out.staged_bytes - out.descriptor_bytes if out else 0)
        return SaveResult(res.seconds, moved)

    async def abort_save(self, request_id: str) -> None:
        try:
            await super().abort_save(request_id)
        finally:
            self._release(request_id)

    # ------------------------------------------------------------------ consumer
    async def _decode(self, frame: Frame) -> Received:
        if frame.kind != Kind.STAGED:
            return await super()._decode(frame)
        try:
            d = _descriptor(frame)
        except nixl_wire.DescriptorError as e:
            raise TransferError(f"bad staged descriptor: {e}", ErrorCode.BAD_HEADER) from None
        want_scales, want_payload = expected_lengths(Kind.LAYER, frame.flags, frame.dtype, frame.num_tokens,
                                                     frame.kv_heads, frame.head_dim)
        if d.nbytes != want_scales + want_payload:
            raise TransferError(f"staged {d.nbytes} bytes, the shape needs {want_scales + want_payload}",
                                ErrorCode.SHAPE_MISMATCH)
        placed = self._destination(frame, d)
        if placed is not None:
            return await self._read_direct(frame, d, *placed)
        if d.nbytes > self.staging.size:
            raise TransferError(f"staged layer of {d.nbytes} bytes exceeds this receiver's staging "
                                f"({self.staging.size})", ErrorCode.TOO_LARGE)
        off = await self._alloc(d.nbytes)
        view = self._view(off, d.nbytes)
        # the region comes back once the READ into it has ended (a timed-out one may still land: drained
        # first) and the importer is done with it
        hold = nixl_direct.Hold(2, lambda: self.staging.free(off))
        try:
            if not await self._read_checked(frame, d, [(self.agent.base + off, d.nbytes)], view, hold.drop):
                raise self._refused(frame, d, "staged bytes")
            k, v, scales = self._layer(frame, view, want_payload)
        except BaseException:
            hold.drop()
            raise
        # The importer reads the region in place (into the cache); it is freed once that returns.
        return Received(k, v, scales, d.nbytes, release=hold.drop)

    def _small(self, d: nixl_wire.Descriptor) -> bool:
        """A layer read on the loop itself: small, from a peer already added (adding one may connect)."""
        with self._remote_lock:
            known = self._remotes.get(d.agent) == d.metadata and self.agent.has_remote(d.agent)
        return known and d.nbytes <= INLINE_MAX

    @staticmethod
    def _layer(frame: Frame, view: memoryview,
               split: int) -> tuple[torch.Tensor, torch.Tensor, codec.Scales | None]:
        """The checked layer as views of its region (valid until the region is freed)."""
        layer = Frame(kind=Kind.LAYER, request_id=frame.request_id, layer=frame.layer,
                      num_layers=frame.num_layers, token_start=frame.token_start, token_end=frame.token_end,
                      kv_heads=frame.kv_heads, head_dim=frame.head_dim, dtype=frame.dtype, flags=frame.flags,
                      payload=view[:split], scales=view[split:], head_start=frame.head_start)
        return codec.wire_kv(layer)

    async def _alloc(self, nbytes: int) -> int:
        deadline = time.monotonic() + self.timeout
        while (off := self.staging.alloc(nbytes)) is None:
            if time.monotonic() > deadline:
                raise TransferError(f"no staging room for {nbytes} bytes within {self.timeout:g} s")
            await asyncio.sleep(0.002)  # regions come back as concurrent reads finish
        return off

    def _remote(self, d: nixl_wire.Descriptor) -> str:
        """The sender's agent, added once per (name, metadata); the least recently used beyond MAX_REMOTES
        is removed (worker thread: adding one may connect)."""
        with self._remote_lock:
            return self._remote_locked(d)

    def _remote_locked(self, d: nixl_wire.Descriptor) -> str:
        known = self._remotes.get(d.agent)
        if known == d.metadata and self.agent.has_remote(d.agent):
            self._remotes.move_to_end(d.agent)
            return d.agent
        if known is not None:
            self._forget(d.agent)
        name = self.agent.add_remote(d.metadata)
        if name != d.agent:
            self.agent.remove_remote(name)
            raise ValueError(f"descriptor names agent {d.agent!r}, its metadata {name!r}")
        self._remotes[name] = d.metadata
        while len(self._remotes) > MAX_REMOTES:
            self._forget(next(iter(self._remotes)))
        return name

    def _forget(self, name: str) -> None:
        with self._remote_lock:
            self._remotes.pop(name, None)
            self.agent.remove_remote(name)
