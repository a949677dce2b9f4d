"""One node of a multi-node job (launch/torchrun_multinode.sh runs this on every node).

    python -m mcore_rl.multinode --nnodes N --node-rank R --master-addr A --master-port P --nproc-per-node M \
        CONFIG [key=value ...]

What `mcore-rl train` gives one machine, for each node:
  * the collectives' interface: GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME, HCCL_SOCKET_IFNAME, HCCL_IF_IP) from the
    route to MASTER_ADDR where unset, refused when that route is loopback (mcore_rl.platform.network);
  * the supervised torchrun (mcore_rl.supervise, mcore_rl.torchrun): signals reach the workers, nothing is left
    running, torchrun's failure table goes to RUN_DIR/torchrun-node<R>.log, and the last console line is the
    reason: the failing rank's exception, or
  * a lost node: each node's launcher writes a heartbeat file under RUN_DIR/nodes every HEARTBEAT_S and reads
    the others'. A node whose heartbeat has not changed for MCORE_RL_NODE_TIMEOUT_S (default 15 s) is lost,
    whether its connections were reset (kill -9) or it vanished without closing them (a link down): the job on
    this node is stopped and one line names the lost node, the newest checkpoint and `checkpoint.resume=auto`.
    The clocks of the nodes are never compared: a heartbeat is fresh when its content changed.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

HEARTBEAT_S = 1.0
TIMEOUT_ENV = "MCORE_RL_NODE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 15.0


@dataclass
class Peer:
    node: int
    content: str = ""
    changed_at: float = 0.0  # time.monotonic() here when its content last changed; 0: never seen to change
    info: Optional[dict] = None


class NodeWatch:
    """This node's heartbeat in RUN_DIR/nodes/node<R>.json and its view of the `peers` nodes' heartbeats (the Ray
    driver: every node's, node_rank None; a Ray node's beat: none)."""

    def __init__(self, run_dir: str, node_rank: Optional[int], peers: Sequence[int], host: str, timeout_s: float):
        self.folder = Path(run_dir) / "nodes"
        self.node_rank, self.host, self.timeout_s = node_rank, host, timeout_s
        self.peers = [Peer(n) for n in peers]
        self.beats = 0
        self.lost: Optional[Peer] = None
        self.stopped = threading.Event()
        self.ended = False  # the final state is written: the heartbeat thread writes no more
        self.lock = threading.Lock()

    def write(self, state: str, line: str = "", failed_at: float = 0.0) -> None:
        with self.lock:
            if not self.ended:
                self.ended = state != "running"
                self._write(state, line, failed_at)

    def _write(self, state: str, line: str, failed_at: float) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.beats += 1
        own = self.folder / f"node{self.node_rank}.json"
        tmp = own.with_suffix(".tmp")
        info = {"node": self.node_rank, "host": self.host, "pid": os.getpid(), "beat": self.beats, "state": state}
        tmp.write_text(json.dumps(info | {"line": line, "failed_at": failed_at}))
        os.replace(tmp, own)

    def read(self) -> None:
        now = time.monotonic()
        for peer in self.peers:
            try:
                content = (self.folder / f"node{peer.node}.json").read_text()
                info = json.loads(content)
            except (OSError, ValueError):
                continue
            if content != peer.content:
                if peer.content:  # the first read may be a previous run's file: seen to change only from now on
                    peer.changed_at, peer.info = now, info
                peer.content = content

    def newly_lost(self) -> Optional[Peer]:
        """A peer seen beating that is still running by its file and has not beaten for timeout_s."""
        now = time.monotonic()
        for peer in self.peers:
            running = peer.info is not None and peer.info.get("state") == "running"
            if running and peer.changed_at and now - peer.changed_at > self.timeout_s:
                return peer
        return None

    def run(self, on_lost) -> None:
        """The heartbeat thread: beat, read, and call on_lost(peer) once when a peer is lost."""
        while not self.stopped.wait(HEARTBEAT_S):
            self.write("running")
            self.read()
            if self.lost is None and (lost := self.newly_lost()) is not None:
                self.lost = lost
                on_lost(lost)

    def settle(self) -> None:
        """After this node's job failed: wait (at most timeout_s + 2 heartbeats) until each peer has ended or
        is lost, so that the reason named is the first node's."""
        deadline = time.monotonic() + self.timeout_s + 2 * HEARTBEAT_S
        while time.monotonic() < deadline and self.lost is None:
            self.write("running")
            self.read()
            self.lost = self.newly_lost()
            if all(p.info is not None and p.info.get("state") != "running" for p in self.peers):
                return
            time.sleep(HEARTBEAT_S / 4)

    def settle_silent(self, grace_s: float = 3 * HEARTBEAT_S) -> None:
        """After a rank failed where no launcher writes its node's end (Ray): wait `grace_s`; a node that has not
        beaten since the failure is given until it beats again or is lost (a rank's failure is often the echo of
        a lost node: then the node is named)."""
        failed = time.monotonic()
        deadline = failed + self.timeout_s + 2 * HEARTBEAT_S
        while self.lost is None and time.monotonic() < deadline:
            self.read()
            self.lost = self.newly_lost()
            if time.monotonic() - failed >= grace_s and all(p.changed_at > failed for p in self.peers):
                return
            time.sleep(HEARTBEAT_S / 4)

    def first_peer_failure(self) -> Optional[dict]:
        failed = [p.info for p in self.peers if p.info and p.info.get("state") == "failed" and p.info.get("line")]
        return min(failed, key=lambda info: info["failed_at"]) if failed else None


def node_timeout_s(env) -> float:
    value = env.get(TIMEOUT_ENV, str(DEFAULT_TIMEOUT_S))
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV}={value!r}: give the seconds after which a silent node is lost") from None


def lost_node_line(peer: Peer, run_dir: str, timeout_s: float, again: str = "start every node again") -> str:
    from mcore_rl.run_dir import CheckpointManager

    info = peer.info or {}
    latest = CheckpointManager(run_dir).latest()
    newest = f"the newest checkpoint is {latest.path}" if latest else "no checkpoint was published yet"
    return (
        f"mcore-rl: error: node {peer.node} ({info.get('host', '?')}) went away: no heartbeat for {timeout_s:g} s "
        f"(RUN_DIR/nodes); {newest}; {again} with checkpoint.resume=auto"
    )


def parse_args(argv: Optional[Sequence[str]] = None):
    parser = argparse.ArgumentParser(prog="python -m mcore_rl.multinode", description=__doc__.split("\n\n")[0])
    for name, default in (("--nnodes", 1), ("--node-rank", 0), ("--master-port", 29500), ("--nproc-per-node", 8)):
        parser.add_argument(name, type=int, default=default)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def torchrun_cmd(args, run_dir: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mcore_rl.torchrun",
        str(Path(run_dir) / f"torchrun-node{args.node_rank}.log"),
        f"--nnodes={args.nnodes}",
        f"--node_rank={args.node_rank}",
        f"--nproc_per_node={args.nproc_per_node}",
        f"--master_addr={args.master_addr}",
        f"--master_port={args.master_port}",
        "-m",
        "mcore_rl.cli",
        "train",
        args.config,
        *args.overrides,
    ]


def network_env(args, env: dict) -> str:
    """Set the interface variables in env; the line that says which interface is used (NetworkError if none)."""
    from mcore_rl.platform.network import interface_env

    added, route = interface_env(args.master_addr, env)
    env.update(added)
    named = ", ".join(f"{k}={v}" for k, v in added.items()) or "all set already"
    return (
        f"mcore-rl: node {args.node_rank} of {args.nnodes} ({socket.gethostname()}) reaches MASTER_ADDR="
        f"{args.master_addr} through {route.interface} ({route.address}): {named}"
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.platform.network import NetworkError
    from mcore_rl.supervise import run_supervised

    args = parse_args(argv)
    env = dict(os.environ)
    try:
        run_dir = load_config(args.config, args.overrides).trainer.run_dir
        if args.nnodes > 1:
            print(network_env(args, env), flush=True)
        timeout_s = node_timeout_s(env)
    except (ConfigError, NetworkError, ValueError) as e:
        print(f"mcore-rl: error: {e}", file=sys.stderr)
        return 2
    peers = [n for n in range(args.nnodes) if n != args.node_rank]
    watch = NodeWatch(run_dir, args.node_rank, peers, socket.gethostname(), timeout_s)
    child: list[int] = []

    def stop_job(peer: Peer) -> None:  # the workers hang in a collective: no step boundary will come
        if child:
            os.kill(child[0], signal.SIGKILL)

    def explain(report: Optional[dict], code: int) -> Optional[str]:
        failed_at = (report or {}).get("at", time.time())
        if code != 0 and (report is None or report.get("crash")):
            watch.settle()  # a crash here is often the echo of a lost or failed node: name the first cause
        line = lost_node_line(watch.lost, run_dir, timeout_s) if watch.lost else report and report["line"]
        peer = watch.first_peer_failure() if watch.lost is None and code != 0 else None
        if peer is not None and (report is None or report.get("crash")) and peer["failed_at"] < failed_at:
            line = f"{peer['line']} (on node {peer['node']}, {peer['host']})"
        watch.write("failed" if code else "done", line or "", failed_at)
        return line

    thread = threading.Thread(target=watch.run, args=(stop_job,), daemon=True)
    watch.write("running")
    thread.start()
    try:
        return run_supervised(torchrun_cmd(args, run_dir), env, on_start=child.append, explain=explain)
    finally:
        watch.stopped.set()


if __name__ == "__main__":
    sys.exit(main())
