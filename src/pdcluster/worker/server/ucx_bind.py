"""The NIXL backend's UCX endpoint listens where the worker does.

UCX picks every usable network device by default, so a worker started with `--host 127.0.0.1` still had its
KV data plane listening on the node's other addresses. Before the first NIXL agent is made, `UCX_NET_DEVICES`
is set to the interface that owns `--host` (`lo` for loopback), plus the node's RDMA ports when the host is
not loopback (they carry no IP listener, and dropping them would drop RDMA). A wildcard host (0.0.0.0, ::,
empty) means every device, as UCX's default; an operator's own `UCX_NET_DEVICES` is kept; a host no local
interface owns (a name, a NAT address) leaves UCX's default and says so in the log.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct
from collections.abc import MutableMapping
from pathlib import Path

log = logging.getLogger(__name__)
ENV = "UCX_NET_DEVICES"
_SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address


def interface_addresses() -> dict[str, str]:
    """IPv4 address -> interface name, for every interface that has one (Linux)."""
    out: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            out[socket.inet_ntoa(raw[20:24])] = name
    return out


def rdma_ports(root: Path = Path("/sys/class/infiniband")) -> list[str]:
    """UCX's names (`mlx5_0:1`) of the node's RDMA ports."""
    if not root.is_dir():
        return []
    return sorted(f"{dev.name}:{port.name}" for dev in root.iterdir() if (dev / "ports").is_dir()
                  for port in (dev / "ports").iterdir())


def device_for(host: str, addresses: dict[str, str] | None = None) -> str | None:
    """The interface UCX should use for a worker listening on `host`; None: every device (UCX's default)."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None  # a name: the operator meant whatever it resolves to
    if ip.is_unspecified:
        return None
    if ip.is_loopback:
        return "lo"
    iface = (addresses if addresses is not None else interface_addresses()).get(str(ip))
    return None if iface is None else ",".join([iface, *rdma_ports()])


def bind_to_host(host: str, env: MutableMapping[str, str] = os.environ) -> str | None:
    """Set UCX_NET_DEVICES for `host` unless the operator set it; the value in force (None: UCX's default)."""
    if env.get(ENV):
        return env[ENV]
    device = device_for(host)
    if device is None:
        if host.strip("[]") not in ("", "0.0.0.0", "::"):
            log.warning("no local interface owns --host %s: the NIXL/UCX data plane uses every device", host)
        return None
    env[ENV] = device
    return device
