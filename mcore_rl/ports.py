"""A free TCP port, without torch: the Ray launcher's rank workers ask for one before their device environment is
set (launch/ray_launch.py), and importing torch there would autoload the device backend too early."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (the rendezvous port of a job; "" binds every interface)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
