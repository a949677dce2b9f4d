"""Two hosts on this machine for multi-node tests: Linux network namespaces joined by a veth pair.

Host i has its own network (the veth end 10.77.0.{i+1}/24 and loopback, nothing else: its traffic cannot leave the
pair), its own hostname, /etc/hosts (bind-mounted by `ip netns exec` from /etc/netns/NAME/hosts), /dev/shm and
process list (`unshare --uts --pid --mount-proc`); the disk, and so the run directory, is shared. `TwoHosts` is a
context manager: leaving it (a failed test too) kills every process of both hosts and deletes the namespaces.
Needs root and `ip` (iproute2).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Optional

SUBNET = "10.77.0"


def can_make_hosts() -> Optional[str]:
    """None when this process can make the hosts, else why not."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install iproute2 util-linux)"
    return None


class TwoHosts:
    """hosts[i]: namespace `{prefix}{i}`, address 10.77.0.{i+1}, hostname node{i}. `loopback_hostname` lists the
    hosts whose /etc/hosts maps their own hostname to 127.0.1.1 (the Debian / Ubuntu default)."""

    def __init__(self, loopback_hostname: tuple[int, ...] = ()):
        self.prefix = f"mrl{os.getpid() % 100000}h"
        self.loopback_hostname = loopback_hostname
        self.procs: list[subprocess.Popen] = []

    def ns(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def addr(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def hostname(self, i: int) -> str:
        return f"node{i}"

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True)

    def __enter__(self) -> "TwoHosts":
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def _make(self) -> None:
        for i in range(2):
            self._ip("netns", "add", self.ns(i))
            self._ip("-n", self.ns(i), "link", "set", "lo", "up")
        self._ip(
            "link", "add", "veth0", "netns", self.ns(0), "type", "veth", "peer", "name", "veth1", "netns", self.ns(1)
        )
        for i in range(2):
            self._ip("-n", self.ns(i), "addr", "add", f"{self.addr(i)}/24", "dev", f"veth{i}")
            self._ip("-n", self.ns(i), "link", "set", f"veth{i}", "up")
            etc = Path("/etc/netns") / self.ns(i)
            etc.mkdir(parents=True, exist_ok=True)
            own = "127.0.1.1" if i in self.loopback_hostname else self.addr(i)
            other = 1 - i
            (etc / "hosts").write_text(
                f"127.0.0.1 localhost\n{own} {self.hostname(i)}\n{self.addr(other)} {self.hostname(other)}\n"
            )

    def popen(self, i: int, cmd: list[str], private: tuple[str, ...] = (), **kwargs) -> subprocess.Popen:
        """Run cmd on host i. `private`: folders of the shared disk that host i sees as its own empty ones."""
        mounts = "".join(f" && mkdir -p {p} && mount -t tmpfs tmpfs {p}" for p in private)
        inner = f'hostname {self.hostname(i)} && mount -t tmpfs tmpfs /dev/shm{mounts} && exec "$@"'
        full = [
            "ip",
            "netns",
            "exec",
            self.ns(i),
            "unshare",
            "--uts",
            "--pid",
            "--fork",
            "--mount-proc",
            "--kill-child",
            "sh",
            "-c",
            inner,
            "host",
            *cmd,
        ]
        proc = subprocess.Popen(full, **kwargs)
        self.procs.append(proc)
        return proc

    def join(self, i: int, first: subprocess.Popen, cmd: list[str], cwd: str, **kwargs) -> subprocess.Popen:
        """Run cmd on host i among the processes of `first` (started by `popen`): its pid namespace, mounts,
        hostname and network (a Ray driver finds its node's raylet in the process list)."""
        import psutil

        init = psutil.Process(first.pid).children()[0].pid  # unshare's child: the pid namespace's init
        proc = subprocess.Popen(["nsenter", "-t", str(init), "-a", f"--wd={cwd}", *cmd], **kwargs)
        self.procs.append(proc)
        return proc

    def kill_host(self, i: int) -> None:
        """kill -9 of everything on host i (the pid namespace's init: the kernel kills the rest)."""
        for pid in self.pids(i):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def link_down(self, i: int) -> None:
        """Host i's end of the pair goes down: its packets stop, nobody's connections are closed."""
        self._ip("-n", self.ns(i), "link", "set", f"veth{i}", "down")

    def link_up(self, i: int) -> None:
        self._ip("-n", self.ns(i), "link", "set", f"veth{i}", "up")

    def pids(self, i: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.ns(i)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def close(self) -> None:
        for i in range(2):
            self.kill_host(i)
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for i in range(2):
            subprocess.run(["ip", "netns", "del", self.ns(i)], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / self.ns(i), ignore_errors=True)

    def __exit__(self, *exc) -> None:
        self.close()
