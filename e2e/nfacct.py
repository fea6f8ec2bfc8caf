"""List or delete the kernel's nfacct objects (netfilter accounting counters) over netlink, stdlib only.

kube-proxy creates two of them (`ct_state_invalid_dropped_pkts`, `localhost_nps_accepted_pkts`) for its
metrics and never deletes them; they outlive it in the host's network namespace. `e2e/node.sh down` removes
the ones that were not there before `up` (Debian's `nfacct` tool would do, but is one more package).

    python3 e2e/nfacct.py list            one name a line
    python3 e2e/nfacct.py delete NAME...  (an object still used by an iptables rule is busy: EBUSY)
"""

from __future__ import annotations

import os
import socket
import struct
import sys

NETLINK_NETFILTER = 12
NFNL_SUBSYS_ACCT = 7
MSG_GET, MSG_DEL = 1, 3  # enum nfnl_acct_msg_types
NFACCT_NAME = 1
NLM_F_REQUEST, NLM_F_ACK, NLM_F_DUMP = 0x1, 0x4, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3


def _request(cmd: int, flags: int, name: str | None = None) -> bytes:
    payload = struct.pack("=BBH", socket.AF_UNSPEC, 0, 0)  # struct nfgenmsg
    if name is not None:
        value = name.encode() + b"\0"
        attr = struct.pack("=HH", 4 + len(value), NFACCT_NAME) + value
        payload += attr + b"\0" * (-len(attr) % 4)
    return struct.pack("=IHHII", 16 + len(payload), (NFNL_SUBSYS_ACCT << 8) | cmd, flags, 1, 0) + payload


def _messages(sock: socket.socket) -> list[tuple[int, bytes]]:
    """Every netlink message up to DONE or an error/ack; raises OSError on an error code."""
    out: list[tuple[int, bytes]] = []
    while True:
        data = sock.recv(1 << 16)
        off = 0
        while off + 16 <= len(data):
            length, mtype, _flags, _seq, _pid = struct.unpack_from("=IHHII", data, off)
            body = data[off + 16: off + length]
            if mtype == NLMSG_DONE:
                return out
            if mtype == NLMSG_ERROR:
                (err,) = struct.unpack_from("=i", body)
                if err:
                    raise OSError(-err, os.strerror(-err))
                return out
            out.append((mtype, body))
            off += (length + 3) & ~3


def _name(body: bytes) -> str | None:
    off = 4  # after struct nfgenmsg
    while off + 4 <= len(body):
        length, atype = struct.unpack_from("=HH", body, off)
        if length < 4:
            break
        if atype & 0x3FFF == NFACCT_NAME:
            return body[off + 4: off + length].split(b"\0", 1)[0].decode()
        off += (length + 3) & ~3
    return None


def list_names() -> list[str]:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as s:
        s.send(_request(MSG_GET, NLM_F_REQUEST | NLM_F_DUMP))
        try:
            msgs = _messages(s)
        except OSError:  # no nfacct support in this kernel: nothing to list
            return []
    return sorted(n for _t, b in msgs if (n := _name(b)) is not None)


def delete(name: str) -> None:
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as s:
        s.send(_request(MSG_DEL, NLM_F_REQUEST | NLM_F_ACK, name))
        _messages(s)


def main(argv: list[str]) -> int:
    if argv[:1] == ["list"]:
        for name in list_names():
            print(name)
        return 0
    if argv[:1] == ["delete"]:
        rc = 0
        for name in argv[1:]:
            try:
                delete(name)
            except OSError as e:
                print(f"nfacct: cannot delete {name}: {e}", file=sys.stderr)
                rc = 1
        return rc
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
