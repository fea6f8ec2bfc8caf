"""Issue 38 row 12: the NIXL/UCX data plane listened on every address despite `--host 127.0.0.1`. server/ucx_bind
picks UCX_NET_DEVICES from the worker's --host before any NIXL agent is made."""

from __future__ import annotations

from pathlib import Path

from pdcluster.worker.server import ucx_bind


def test_loopback_host_keeps_ucx_on_loopback() -> None:
    env: dict[str, str] = {}
    assert ucx_bind.bind_to_host("127.0.0.1", env) == "lo" and env == {ucx_bind.ENV: "lo"}
    assert ucx_bind.device_for("::1") == "lo"


def test_a_specific_address_picks_its_interface_and_every_device_is_the_wildcards() -> None:
    addrs = ucx_bind.interface_addresses()
    assert addrs.get("127.0.0.1") == "lo"  # read from the kernel, not assumed
    for ip, iface in addrs.items():
        if ip != "127.0.0.1":
            assert ucx_bind.device_for(ip, addrs).split(",")[0] == iface  # type: ignore[union-attr]
    for wildcard in ("0.0.0.0", "::", ""):
        env: dict[str, str] = {}
        assert ucx_bind.bind_to_host(wildcard, env) is None and env == {}
    assert ucx_bind.device_for("203.0.113.7", {"127.0.0.1": "lo"}) is None  # no interface owns it


def test_the_operators_own_setting_is_kept() -> None:
    env = {ucx_bind.ENV: "mlx5_0:1"}
    assert ucx_bind.bind_to_host("127.0.0.1", env) == "mlx5_0:1" and env[ucx_bind.ENV] == "mlx5_0:1"


def test_rdma_ports_are_named_as_ucx_names_them(tmp_path: Path) -> None:
    for dev, ports in (("mlx5_0", ("1",)), ("mlx5_1", ("1", "2"))):
        for p in ports:
            (tmp_path / dev / "ports" / p).mkdir(parents=True)
    assert ucx_bind.rdma_ports(tmp_path) == ["mlx5_0:1", "mlx5_1:1", "mlx5_1:2"]
    assert ucx_bind.rdma_ports(tmp_path / "absent") == []
