"""Which network interface a multi-node job's collectives use on this node (no torch).

Gloo (and NCCL / HCCL) pick their own address from the hostname when no interface is named: where the hostname
resolves to 127.0.1.1 (the Debian / Ubuntu default) a node advertises a loopback address to the others and the
job dies in `connectFullMesh` or hangs. The route to MASTER_ADDR names the right interface: `socket_interface`
asks the kernel (a UDP socket `connect`ed to MASTER_ADDR sends nothing but gets the source address of that
route) and finds the interface that holds that address.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass
from typing import Mapping

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
# Each library's variable for the interface of its sockets; HCCL_IF_IP takes the address instead.
INTERFACE_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "HCCL_SOCKET_IFNAME")
ADDRESS_ENV = ("HCCL_IF_IP",)


class NetworkError(ValueError):
    """This node cannot reach MASTER_ADDR through a usable (non-loopback) address."""


@dataclass(frozen=True)
class Route:
    interface: str
    address: str  # this node's address on it


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def socket_interface(master_addr: str) -> Route:
    """This node's interface and address on the route to master_addr (a host name or an IPv4 address)."""
    try:
        target = socket.gethostbyname(master_addr)
    except OSError as e:
        raise NetworkError(f"MASTER_ADDR={master_addr} does not resolve on this node ({e})") from e
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((target, 9))  # UDP: no packet is sent, the kernel only picks the route
        except OSError as e:
            raise NetworkError(f"no route from this node to MASTER_ADDR={master_addr} ({target}): {e}") from e
        local = s.getsockname()[0]
    if ipaddress.ip_address(local).is_loopback:
        raise NetworkError(
            f"MASTER_ADDR={master_addr} is {target} on this node, a loopback address: the other nodes cannot reach "
            f"it. Set MASTER_ADDR to node 0's address on the network every node shares (check /etc/hosts)"
        )
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return Route(name, local)
    raise NetworkError(f"no interface holds {local}, this node's address on the route to {master_addr}")


def interface_env(master_addr: str, environ: Mapping[str, str]) -> tuple[dict[str, str], Route]:
    """The interface variables that `environ` leaves unset, from the route to master_addr; and the route."""
    route = socket_interface(master_addr)
    values = {name: route.interface for name in INTERFACE_ENV} | {name: route.address for name in ADDRESS_ENV}
    return {k: v for k, v in values.items() if not environ.get(k)}, route
