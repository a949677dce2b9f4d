"""Launch mcore-rl training on a Ray cluster: a placement group of one bundle per rank, one actor per rank.

    python launch/ray_launch.py CONFIG [key=value ...] [--address auto] [--nnodes N --nproc-per-node M]
        [--accelerator GPU|NPU|CPU] [--cpus-per-rank K] [--entry mcore_rl.trainer:run]

Each actor gets the torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT) and calls the entry (default `mcore_rl.trainer.run(cfg)`), so the trainer runs
exactly as under torchrun. Ray gives each actor one device and hides the others (CUDA_VISIBLE_DEVICES /
ASCEND_RT_VISIBLE_DEVICES); the actor re-exposes the devices that this job holds on its node, ordered by
local rank, so that `LOCAL_RANK` indexes its own device as it does under torchrun.

On several nodes a NodeBeat actor on each node writes the heartbeat of mcore_rl.multinode into RUN_DIR/nodes and
the driver reads them: a node silent for MCORE_RL_NODE_TIMEOUT_S seconds (default 15) ends the job with one line
naming it, the newest checkpoint and checkpoint.resume=auto (docs/reliability.md#several-machines).

Ray is an optional extra (pip install 'mcore-rl[ray]'): it is imported only when this script runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional, Sequence

VISIBLE_DEVICES_ENV = {"GPU": "CUDA_VISIBLE_DEVICES", "NPU": "ASCEND_RT_VISIBLE_DEVICES"}


@dataclass(frozen=True)
class RankPlacement:
    rank: int
    local_rank: int
    local_world_size: int
    node_rank: int
    node_ip: str
    visible_devices: tuple[str, ...]  # this job's devices on the node, in local-rank order (empty on CPU)


def bundles(world_size: int, accelerator: str, cpus_per_rank: float) -> list[dict]:
    bundle = {"CPU": cpus_per_rank}
    if accelerator != "CPU":
        bundle[accelerator] = 1
    return [dict(bundle) for _ in range(world_size)]


def assign_ranks(infos: Sequence[tuple[str, Sequence[str]]], driver_ip: str = "") -> list[RankPlacement]:
    """Ranks for actors given (node ip, accelerator ids) per actor, in bundle order; returns one per actor.

    The driver's node is node 0 when it holds ranks (rank 0 = MASTER_ADDR there: the same master on every launch,
    whichever node Ray's PACK strategy filled first); the other nodes follow in order of first appearance. Ranks
    are contiguous per node (as torchrun numbers them), ordered by device id within a node.
    """
    nodes: dict[str, list[int]] = {}
    for i, (ip, _) in sorted(enumerate(infos), key=lambda item: item[1][0] != driver_ip):
        nodes.setdefault(ip, []).append(i)

    def device_key(i: int):
        ids = infos[i][1]
        return (0, int(ids[0]), i) if ids and str(ids[0]).isdigit() else (1, str(ids[0]) if ids else "", i)

    placements: dict[int, RankPlacement] = {}
    rank = 0
    for node_rank, (ip, members) in enumerate(nodes.items()):
        ordered = sorted(members, key=device_key)
        devices = tuple(str(infos[i][1][0]) for i in ordered if infos[i][1])
        for local_rank, i in enumerate(ordered):
            placements[i] = RankPlacement(rank, local_rank, len(ordered), node_rank, ip, devices)
            rank += 1
    return [placements[i] for i in range(len(infos))]


def rank_env(
    p: RankPlacement, world_size: int, master_addr: str, master_port: int, accelerator: str, run=None
) -> dict[str, str]:
    """The rank's environment; `run` (mcore_rl.platform.RunEnvironment of the config): the Ascend variables the
    run's config decides (HCCL_EXEC_TIMEOUT, TASK_QUEUE_ENABLE, trainer.deterministic's)."""
    env = {
        "RANK": str(p.rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(p.local_rank),
        "LOCAL_WORLD_SIZE": str(p.local_world_size),
        "GROUP_RANK": str(p.node_rank),
        "NODE_RANK": str(p.node_rank),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }
    if accelerator in VISIBLE_DEVICES_ENV and p.visible_devices:
        env[VISIBLE_DEVICES_ENV[accelerator]] = ",".join(p.visible_devices)
    if accelerator == "NPU":  # the Ascend environment of mcore_rl.platform (docs/devices.md); a driver value wins
        from mcore_rl.platform.ascend_env import ascend_environment

        env.update({k: os.environ.get(k, v) for k, v in ascend_environment(run).items()})
    env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    return env


# Every path of the config, resolved against the driver's working directory before the config is shipped: a rank
# runs in Ray's working directory (a temp folder on another node), where a relative path names nothing.
PATH_FIELDS = ("model.path", "data.train_path", "data.val_path", "trainer.run_dir", "rollout.rebuild_dir")


def resolve_paths(cfg, base: str) -> list[str]:
    """Make the config's relative paths absolute against `base` (in place); the keys changed."""
    changed = []
    for key in PATH_FIELDS + (() if cfg.checkpoint.resume in ("auto", "never") else ("checkpoint.resume",)):
        section, name = key.split(".")
        holder = getattr(cfg, section)
        value = getattr(holder, name)
        if value and not os.path.isabs(value):
            setattr(holder, name, os.path.normpath(os.path.join(base, value)))
            changed.append(key)
    return changed


def rank_failure(error: BaseException, rank: int) -> str:
    """The launcher's last line for a rank that raised: the exception's last line and where it was raised. Made
    in the rank (RankWorker.run), where the traceback is; the driver gets the exception without it."""
    import traceback

    frames = traceback.extract_tb(error.__traceback__)
    where = f" ({os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    text = traceback.format_exception_only(type(error), error)[-1].strip()
    return f"mcore-rl: error: rank {rank} failed: {text}{where}"


def failure_line(error: BaseException, rank: int) -> str:
    """The driver's last line for a failed rank: the line its rank made, when Ray kept it (RayTaskError.cause)."""
    cause = getattr(error, "cause", None) or error
    return getattr(cause, "launcher_line", None) or f"mcore-rl: error: rank {rank} failed: {cause}"


def resolve_entry(entry: str):
    module, _, function = entry.partition(":")
    if not function:
        raise ValueError(f"--entry {entry!r}: write it as package.module:function, e.g. mcore_rl.trainer:run")
    return getattr(importlib.import_module(module), function)


class RankWorker:
    """One training rank (wrapped with ray.remote at launch time)."""

    def node_info(self) -> tuple[str, list[str]]:
        import ray

        ids = ray.get_runtime_context().get_accelerator_ids()
        devices = [str(d) for key in ("GPU", "NPU") for d in ids.get(key, [])]
        return ray.util.get_node_ip_address(), devices

    # Both methods run in the rank's process before (free_port) or until (run) its environment is set: nothing
    # that imports torch may come first (torch >= 2.5 autoloads device backends at import, before
    # ASCEND_RT_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES name this job's devices).
    def free_port(self) -> int:
        from mcore_rl.ports import free_port

        return free_port(host="")  # rank 0's node hosts the rendezvous: a port free on every interface

    def run(self, env: dict, cfg, entry: str, nodes: int = 1):
        os.environ.update(env)  # before anything imports torch, initialises torch.distributed or the device
        from mcore_rl.safety import StopRequested

        if nodes > 1:  # the collectives' interface: this node's route to MASTER_ADDR (as torchrun_multinode.sh)
            from mcore_rl.platform.network import interface_env

            os.environ.update(interface_env(env["MASTER_ADDR"], os.environ)[0])

        try:
            return resolve_entry(entry)(cfg)
        except StopRequested as e:  # stopped as asked (RUN_DIR/STOP, written by the driver on SIGTERM)
            return f"stopped: {e}"
        except Exception as e:  # travels to the driver with the exception (its __dict__ is pickled)
            e.launcher_line = rank_failure(e, int(env.get("RANK", "0")))
            raise


def parse_args(argv: Optional[Sequence[str]] = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    parser.add_argument(
        "--address", default=None, help="Ray cluster address (auto, HOST:PORT); default: start a local Ray"
    )
    parser.add_argument("--nnodes", type=int, default=None, help="default trainer.nnodes")
    parser.add_argument("--nproc-per-node", type=int, default=None, help="default trainer.nproc")
    parser.add_argument(
        "--accelerator", choices=("GPU", "NPU", "CPU"), default=None, help="default from the config's platform"
    )
    parser.add_argument("--cpus-per-rank", type=float, default=1.0)
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of a local Ray (no --address)")
    parser.add_argument(
        "--model-config", default=None, help="config.json for the pre-flight check (default model.path)"
    )
    parser.add_argument("--entry", default="mcore_rl.trainer:run", help="function called with the Config on every rank")
    args, extra = parser.parse_known_args(argv)
    bad = [e for e in extra if e.startswith("-") or "=" not in e]
    if bad:
        parser.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = list(args.overrides) + extra
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    from mcore_rl.cli import preflight
    from mcore_rl.config import ConfigError, load_config
    from mcore_rl.multinode import NodeWatch, node_timeout_s
    from mcore_rl.preflight.layout import LayoutError

    args = parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        resolve_paths(cfg, os.getcwd())
        nnodes = args.nnodes or cfg.trainer.nnodes
        nproc = args.nproc_per_node or cfg.trainer.nproc
        cfg.trainer.nnodes, cfg.trainer.nproc = nnodes, nproc
        world = nnodes * nproc
        accelerator = args.accelerator or {"cuda": "GPU", "npu": "NPU", "cpu": "CPU"}.get(cfg.platform)
        if accelerator is None:
            raise ConfigError(
                "platform = auto: pass --accelerator GPU|NPU|CPU (or set platform) so the bundles ask for the right device"
            )
        layout = preflight(cfg, world, args.model_config)
        timeout_s = node_timeout_s(os.environ)
    except (ConfigError, LayoutError, ValueError) as e:
        print(f"ray_launch: error: {e}", file=sys.stderr)
        return 2
    for warning in layout.warnings:
        print(f"ray_launch: warning: {warning}", file=sys.stderr)

    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.num_cpus, include_dashboard=False)
    pg = placement_group(bundles(world, accelerator, args.cpus_per_rank), strategy="PACK")
    ray.get(pg.ready())
    options = {"num_cpus": args.cpus_per_rank}
    if accelerator == "GPU":
        options["num_gpus"] = 1
    elif accelerator == "NPU":
        options["resources"] = {"NPU": 1}
    Worker = ray.remote(RankWorker)
    beats: list = []
    line, stop = None, []
    workers = [
        Worker.options(
            **options, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        ).remote()
        for i in range(world)
    ]
    try:
        placements = assign_ranks(ray.get([w.node_info.remote() for w in workers]), ray.util.get_node_ip_address())
        by_rank = sorted(zip(placements, workers), key=lambda pw: pw[0].rank)
        master_addr = by_rank[0][0].node_ip
        master_port = ray.get(by_rank[0][1].free_port.remote())
        nodes = len({p.node_ip for p in placements})
        print(f"ray_launch: {world} ranks on {nodes} node(s), master {master_addr}:{master_port}", flush=True)
        from mcore_rl.platform.ascend_env import RunEnvironment

        run = RunEnvironment.of(cfg)
        watch = None
        if nodes > 1:  # every node beats from before its ranks start (mcore_rl.multinode: a lost node)
            beats = start_beats(pg, placements, cfg.trainer.run_dir, timeout_s)
            watch = NodeWatch(cfg.trainer.run_dir, None, range(nodes), socket.gethostname(), timeout_s)
        pending = [
            w.run.remote(rank_env(p, world, master_addr, master_port, accelerator, run), cfg, args.entry, nodes)
            for p, w in by_rank
        ]
        rank_of = {ref: p.rank for ref, (p, _) in zip(pending, by_rank)}
        stop = request_stop_on_signals(cfg.trainer.run_dir)
        line = wait_for_ranks(pending, rank_of, watch)
    except Exception as e:  # placing the ranks failed
        line = f"ray_launch: error: {e}"
    finally:
        for w in workers + beats:
            ray.kill(w)
        remove_placement_group(pg)
        # Ray forwards the ranks' output to this console from a thread of its own, late lines too: disconnect
        # first, so that nothing of theirs prints after the last line below
        sys.stdout.flush()
        ray.shutdown()
    if line:
        print(line, file=sys.stderr, flush=True)  # the last line: the cause
        return 1
    if stop:
        return 128 + stop[0]
    print("ray_launch: all ranks finished", flush=True)
    return 0


class NodeBeat:
    """One node's heartbeat, RUN_DIR/nodes/node<R>.json every second (mcore_rl.multinode.NodeWatch), from a process
    of its own on that node: a rank busy or hung in a collective still beats; the node gone, the beats stop."""

    def start(self, run_dir: str, node_rank: int, timeout_s: float) -> str:
        import socket
        import threading

        from mcore_rl.multinode import NodeWatch

        self.watch = NodeWatch(run_dir, node_rank, (), socket.gethostname(), timeout_s)
        self.watch.write("running")
        threading.Thread(target=self.watch.run, args=(None,), daemon=True).start()
        return self.watch.host


def start_beats(pg, placements: Sequence[RankPlacement], run_dir: str, timeout_s: float) -> list:
    """A NodeBeat on every node of the job, in the bundle of the node's first rank (it asks for no resources)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    first: dict[int, int] = {}
    for i, p in enumerate(placements):
        first.setdefault(p.node_rank, i)
    Beat = ray.remote(NodeBeat)
    beats = {
        node: Beat.options(
            num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        ).remote()
        for node, i in first.items()
    }
    ray.get([beat.start.remote(run_dir, node, timeout_s) for node, beat in beats.items()])
    return list(beats.values())


def wait_for_ranks(pending: list, rank_of: dict, watch) -> Optional[str]:
    """Wait until every rank has returned; None, or the line that says why the job failed: a lost node (`watch`:
    the nodes' heartbeats, None on one node) or a failed rank (after waiting for a node whose loss it echoes)."""
    import ray

    from mcore_rl.multinode import HEARTBEAT_S, lost_node_line

    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=HEARTBEAT_S)
        failure = None
        for ref in done:
            try:
                result = ray.get(ref)  # raises the rank's exception; main's finally stops the other ranks
            except Exception as e:  # one rank failed: the rest would hang in collectives
                print(f"ray_launch: a rank failed:\n{e}", file=sys.stderr)
                failure = failure_line(e, rank_of[ref])
                if watch is not None:
                    watch.settle_silent()
                continue
            if isinstance(result, str) and result.startswith("stopped: "):
                print(f"ray_launch: {result[len('stopped: ') :]}", file=sys.stderr, flush=True)
        if watch is not None:
            watch.read()
            watch.lost = watch.lost or watch.newly_lost()
            if watch.lost:
                again = "run launch/ray_launch.py again"
                return lost_node_line(watch.lost, str(watch.folder.parent), watch.timeout_s, again)
        if failure:
            return failure
    return None


def request_stop_on_signals(run_dir: str) -> list[int]:
    """SIGTERM / SIGINT to this driver write RUN_DIR/STOP: every rank stops after its current step (a
    checkpoint being written is published first) and returns; a second signal stops the driver at once
    (its `finally` kills the ranks). The returned list receives the signal numbers."""
    import signal

    from mcore_rl.safety import STOP_FILE

    received: list[int] = []

    def handle(signum, frame):
        received.append(signum)
        if len(received) > 1:
            raise KeyboardInterrupt
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, STOP_FILE), "w") as f:
            f.write(f"{signal.Signals(signum).name} to ray_launch pid {os.getpid()}\n")
        print(f"ray_launch: {signal.Signals(signum).name}: the ranks stop after their current step", file=sys.stderr)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    return received


if __name__ == "__main__":
    sys.exit(main())
