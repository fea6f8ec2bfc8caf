"""NIXL's data plane across two processes on one machine (UCX shared memory / TCP): a registered host
buffer written into another process's registered buffer arrives byte-exact, and both agents deregister.
Skipped, with the reason, where nixl does not load."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from pdcluster.worker.transfer.nixl_agent import Agent, availability

AVAILABLE = availability()
pytestmark = pytest.mark.skipif(not AVAILABLE.ok, reason=AVAILABLE.reason)

TARGET = textwrap.dedent("""
    import sys, torch
    from pdcluster.worker.transfer.nixl_agent import Agent
    n = int(sys.argv[1])
    a = Agent("test-target", n)
    sys.stdout.write("META " + a.metadata().hex() + " " + str(a.base) + "\\n"); sys.stdout.flush()
    sys.stdin.readline()  # the writer is done
    g = torch.Generator().manual_seed(7)
    want = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
    ok = torch.equal(a.buffer, want)
    a.close()
    print("RESULT", "exact" if ok else "differs", flush=True)
""")


def marked(stream, tag: str) -> list[str]:  # type: ignore[no-untyped-def]
    for line in stream:
        if line.startswith(tag + " "):
            return line.split()[1:]
    raise AssertionError(f"the target process ended without a {tag} line")


def test_write_into_another_process_is_byte_exact() -> None:
    n = 8 << 20
    p = subprocess.Popen([sys.executable, "-c", TARGET, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    try:
        assert p.stdout is not None and p.stdin is not None
        meta_hex, base = marked(p.stdout, "META")  # nixl logs to stdout too
        a = Agent("test-initiator", n)
        g = torch.Generator().manual_seed(7)
        a.buffer.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
        peer = a.add_remote(bytes.fromhex(meta_hex))
        a.write(peer, 0, int(base), n, timeout=60)
        a.close()
        p.stdin.write("done\n")
        p.stdin.flush()
        assert marked(p.stdout, "RESULT") == ["exact"]
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()


def test_close_deregisters_and_forgets_peers() -> None:
    a, b = Agent("t-a", 1 << 16), Agent("t-b", 1 << 16)
    a.add_remote(b.metadata())
    a.close()
    b.close()
    assert not a.registered and not a._remotes and not b.registered
