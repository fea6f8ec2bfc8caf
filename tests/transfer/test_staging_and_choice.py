"""Pure parts of the NIXL backend: the staging allocator, the descriptor and MAC, the backend choice."""

from __future__ import annotations

import pytest

from pdcluster.worker.transfer import nixl_wire
from pdcluster.worker.transfer.backend import BackendUnavailable, choose
from pdcluster.worker.transfer.nixl_agent import Availability
from pdcluster.worker.transfer.staging import ALIGN, Staging

LOADS = Availability(True, "nixl with the UCX backend loads")
MISSING = Availability(False, "nixl is not importable (ImportError: no module named nixl_cu12)")


def test_first_fit_reuses_holes_and_refuses_when_full() -> None:
    s = Staging(4 * ALIGN)
    a, b, c = s.alloc(ALIGN), s.alloc(ALIGN + 1), s.alloc(ALIGN)
    assert (a, b, c) == (0, ALIGN, 3 * ALIGN)
    assert s.alloc(1) is None  # full: the caller decides (TCP fallback / wait), never blocks
    s.free(b)
    assert s.alloc(2 * ALIGN) == ALIGN  # the freed hole, aligned size
    s.free(a)
    s.free(c)
    s.free(ALIGN)
    assert (s.used, s.regions) == (0, 0)


def test_double_free_and_empty_region_are_errors() -> None:
    s = Staging(1024)
    off = s.alloc(10)
    assert off is not None
    s.free(off)
    with pytest.raises(KeyError):
        s.free(off)
    with pytest.raises(ValueError):
        s.alloc(0)


def test_descriptor_round_trip_and_bad_lengths() -> None:
    d = nixl_wire.Descriptor(0x7F00_0000_1000, 4096, 0, b"s" * 16, b"t" * 16, "pdkv-abc", b"m" * 452)
    assert nixl_wire.unpack(d.pack()) == d
    packed = d.pack()
    for bad in (packed[:-1], packed + b"x", packed[:20]):
        with pytest.raises(nixl_wire.DescriptorError):
            nixl_wire.unpack(bad)


def test_mac_binds_secret_request_layer_tokens_and_bytes() -> None:
    data = bytes(range(256)) * 4
    salt = b"\x01" * 16
    tag = nixl_wire.mac(b"k" * 32, salt, "r1", 3, 16, data)
    d = nixl_wire.Descriptor(0, len(data), 0, salt, tag, "a", b"m")
    assert nixl_wire.verify(b"k" * 32, d, "r1", 3, 16, data)
    assert not nixl_wire.verify(b"x" * 32, d, "r1", 3, 16, data)  # other secret
    assert not nixl_wire.verify(b"k" * 32, d, "r2", 3, 16, data)  # other request
    assert not nixl_wire.verify(b"k" * 32, d, "r1", 4, 16, data)  # other layer
    assert not nixl_wire.verify(b"k" * 32, d, "r1", 3, 0, data)  # other token range
    assert not nixl_wire.verify(b"k" * 32, d, "r1", 3, 16, b"\xff" + data[1:])  # one byte changed


@pytest.mark.parametrize(("requested", "nixl", "backend", "fallback"), [
    ("auto", LOADS, "nixl", False),
    ("auto", MISSING, "tcp", True),
    ("nixl", LOADS, "nixl", False),
    ("tcp", LOADS, "tcp", False),
    ("tcp", MISSING, "tcp", False),
])
def test_choice(requested: str, nixl: Availability, backend: str, fallback: bool) -> None:
    c = choose(requested, nixl)
    assert (c.backend, c.fallback) == (backend, fallback)
    assert c.message.startswith(f"kv transfer backend: {backend} (")
    if fallback:
        assert "not importable" in c.message  # the one log line says why


def test_explicit_nixl_that_cannot_load_is_an_error_naming_why() -> None:
    with pytest.raises(BackendUnavailable, match="not importable"):
        choose("nixl", MISSING)
    with pytest.raises(ValueError, match="one of"):
        choose("rdma", LOADS)
