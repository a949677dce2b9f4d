"""The multi-node launchers across two hosts: network namespaces on this machine (tests/netns_hosts.py), each with
its own hostname, /etc/hosts, /dev/shm and process list, joined by a veth pair (10.77.0.1 / 10.77.0.2); the run
directory on the shared disk. Each host's hostname resolves to 127.0.1.1 (the Debian / Ubuntu default): without
GLOO_SOCKET_IFNAME gloo advertises that address and node 1 dies in connectFullMesh (`Connection refused,
remote=[127.0.1.1]`; with node 0's hostname alone resolving there, too), so the launcher names the interface. Each job: 2 nodes x 1 process, the demo preset
(configs/tiny/gspo_cpu.yaml) cut to a few small steps. Needs root (CI runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mcore_rl.run_dir import CheckpointManager, verify_checkpoint
from tests.netns_hosts import TwoHosts, can_make_hosts
from tests.torchrun_util import REPO

pytestmark = [pytest.mark.slow, pytest.mark.skipif(can_make_hosts() is not None, reason=str(can_make_hosts()))]

TIMING_PREFIXES = ("time", "perf/", "time/", "sync/seconds", "sync/gb_per_s")
NODE_TIMEOUT_S = 8  # MCORE_RL_NODE_TIMEOUT_S of the jobs here
PRESET = str(REPO / "configs/tiny/gspo_cpu.yaml")


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from mcore_rl.data.task import make_task_dataset

    train, val = make_task_dataset(tmp_path_factory.mktemp("task"), train_size=64, val_size=8, seed=0)
    return str(train), str(val)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, task, tmp_path_factory) -> list[dict]:
    """A single-host 2-process run of the demo preset's 4 steps, the rows the 2-node jobs must equal."""
    run_dir = tmp_path_factory.mktemp("reference")
    proc = single_host(settings(tiny_model_dir, task, run_dir))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and sum(len(row) for row in rows) > 80
    return rows


@pytest.fixture
def hosts():
    with TwoHosts(loopback_hostname=(0, 1)) as made:
        yield made


def settings(model, task, run_dir, steps: int = 4, **extra) -> list[str]:
    values = {
        "model.path": model,
        "data.train_path": task[0],
        "data.val_path": task[1],
        "trainer.run_dir": str(run_dir),
        "trainer.val_every": 0,
        "trainer.steps": steps,
        "checkpoint.save_every": 2,
        "data.prompts_per_step": 4,
        "rollout.n": 4,
        "actor.parallel.micro_batch_size": 4,
        "trainer.plots": "false",  # not what these jobs check
        **extra,
    }
    return [f"{k}={v}" for k, v in values.items()]


def node_env(node: int, **extra) -> dict:
    env = dict(
        os.environ,
        NNODES="2",
        NODE_RANK=str(node),
        MASTER_ADDR="10.77.0.1",
        MASTER_PORT="29500",
        NPROC_PER_NODE="1",
        PYTHON=sys.executable,
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS="1",
        MCORE_RL_NODE_TIMEOUT_S=str(NODE_TIMEOUT_S),
    )
    return env | extra


def start_nodes(hosts: TwoHosts, args: list[str], logs: Path, private=((), ()), **extra) -> list[subprocess.Popen]:
    logs.mkdir(parents=True, exist_ok=True)
    cmd = ["bash", str(REPO / "launch" / "torchrun_multinode.sh"), PRESET, *args]
    return [
        hosts.popen(
            i,
            cmd,
            private[i],
            stdout=open(logs / f"node{i}.log", "w"),
            stderr=subprocess.STDOUT,
            env=node_env(i, **extra),
            cwd=REPO,
        )
        for i in range(2)
    ]


def finish(procs: list[subprocess.Popen], logs: Path, timeout: float = 300) -> list[str]:
    """Each node's output once both have ended; a node still running after `timeout` fails the test."""
    deadline = time.time() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            outs = [(logs / f"node{i}.log").read_text()[-4000:] for i in range(2)]
            raise AssertionError(f"a node did not end within {timeout} s:\n" + "\n".join(outs)) from None
    return [(logs / f"node{i}.log").read_text() for i in range(2)]


def metrics(run_dir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)} for row in rows]


def last_line(out: str) -> str:
    return [line for line in out.splitlines() if line.strip()][-1]


def single_host(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mcore_rl.cli", "train", PRESET, *args]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def test_two_nodes_train_as_one_host_and_a_lost_node_is_one_line(hosts, tiny_model_dir, task, reference, tmp_path):
    """torchrun_multinode.sh on two hosts: node 1's link goes down after the step-2 checkpoint and its processes are
    killed (-9): node 0 ends within the stated bound with one line naming node 1, the newest checkpoint and
    checkpoint.resume=auto; a 2-node resume then continues, and the 2-node run's metrics (steps 1-2 before the
    loss, 3-4 after) equal a single-host 2-process run's, value for value."""
    lost = tmp_path / "lost"
    logs = tmp_path / "logs-b"
    procs = start_nodes(hosts, settings(tiny_model_dir, task, lost, steps=40), logs)
    wait_for_checkpoint(lost, 2, procs[0], logs / "node0.log")
    for i in range(2):  # the interface comes from the route to MASTER_ADDR, not from the hostname (node 1: 127.0.1.1)
        line = f"reaches MASTER_ADDR=10.77.0.1 through veth{i} (10.77.0.{i + 1}): GLOO_SOCKET_IFNAME=veth{i}"
        assert line in (logs / f"node{i}.log").read_text()
    hosts.link_down(1)  # node 1 vanishes without closing its connections, then dies
    hosts.kill_host(1)
    gone = time.time()
    out = finish(procs[:1], logs, timeout=NODE_TIMEOUT_S + 60)[0]
    took = time.time() - gone
    newest = CheckpointManager(lost).latest()
    errors = [line for line in out.splitlines() if line.startswith("mcore-rl: error:")]
    assert len(errors) == 1 and errors[0] == last_line(out), out[-3000:]
    assert "node 1 (node1) went away" in errors[0] and str(newest.path) in errors[0], errors
    assert "checkpoint.resume=auto" in errors[0] and procs[0].returncode != 0
    assert took < NODE_TIMEOUT_S + 30, took  # the stated bound: timeout + a few heartbeats + stopping the job
    assert verify_checkpoint(newest) == []
    print(f"node 0 ended {took:.1f} s after node 1 went away (MCORE_RL_NODE_TIMEOUT_S={NODE_TIMEOUT_S})")

    hosts.link_up(1)
    resumed = settings(tiny_model_dir, task, lost, steps=4, **{"checkpoint.resume": "auto"})
    finish(start_nodes(hosts, resumed, tmp_path / "logs-c"), tmp_path / "logs-c")
    rows = metrics(lost)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
    assert rows == reference


def wait_for_checkpoint(run_dir: Path, step: int, proc: subprocess.Popen, log: Path, timeout: float = 240) -> None:
    deadline = time.time() + timeout
    while (CheckpointManager(run_dir).latest() is None or CheckpointManager(run_dir).latest().step < step) and (
        proc.poll() is None
    ):
        assert time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.2)
    assert proc.poll() is None, log.read_text()[-3000:]


def on_host(hosts: TwoHosts, i: int, cmd: list[str], **extra) -> subprocess.CompletedProcess:
    proc = hosts.popen(
        i, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=node_env(i, **extra), cwd=REPO
    )
    out, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def test_the_interface_comes_from_the_route_and_a_loopback_master_is_refused(hosts, tiny_model_dir, task, tmp_path):
    """The hostnames resolve to 127.0.1.1: the interface and address come from the route to MASTER_ADDR (the
    reference: `ip route get` on node 1; on node 0, MASTER_ADDR's own interface), and MASTER_ADDR=node1 (a loopback
    address there) is refused in one line before torchrun starts."""
    probe = "import sys; from mcore_rl.platform.network import socket_interface as s; print(s(sys.argv[1]))"
    for i, master in ((1, "10.77.0.1"), (1, "node0"), (0, "10.77.0.1")):
        got = on_host(hosts, i, [sys.executable, "-c", probe, master])
        assert got.returncode == 0, got.stderr
        route = on_host(hosts, i, ["ip", "route", "get", "10.77.0.1"]).stdout.split()
        dev = route[route.index("dev") + 1] if i == 1 else "veth0"  # on node 0, `ip route get` says lo (local)
        expected = f"Route(interface='{dev}', address='{route[route.index('src') + 1]}')"
        assert got.stdout.strip() == expected and f"veth{i}" in expected, (got.stdout, route)
    cmd = ["bash", str(REPO / "launch" / "torchrun_multinode.sh"), PRESET]
    refused = on_host(hosts, 1, cmd + settings(tiny_model_dir, task, tmp_path / "run"), MASTER_ADDR="node1")
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert last_line(refused.stderr) == (
        "mcore-rl: error: MASTER_ADDR=node1 is 127.0.1.1 on this node, a loopback address: the other nodes cannot "
        "reach it. Set MASTER_ADDR to node 0's address on the network every node shares (check /etc/hosts)"
    )
    assert not (tmp_path / "run").exists()  # refused before torchrun: nothing written


def test_a_run_directory_that_is_not_shared_is_refused(hosts, tiny_model_dir, task, tmp_path):
    """Node 1 sees its own (empty) folder at trainer.run_dir: every node ends with the reason, before a step."""
    run_dir = tmp_path / "run"
    logs = tmp_path / "logs"
    args = settings(tiny_model_dir, task, run_dir)
    outs = finish(start_nodes(hosts, args, logs, private=((), (str(run_dir),))), logs, timeout=240)
    for out in outs:
        assert last_line(out).startswith(
            f"mcore-rl: error: trainer.run_dir = {run_dir} is not the same directory on every node: node1 does not "
            f"see the token rank 0 wrote"
        ), out[-3000:]
        assert "step 1/" not in out


def test_ray_two_nodes_train_as_one_host_and_a_lost_node_is_one_line(hosts, tiny_model_dir, task, reference, tmp_path):
    """launch/ray_launch.py with a Ray head on node 0, a worker on node 1 (both started in `/`) and the driver on
    node 0: the demo preset, one rank a node. Node 1's link goes down after the step-2 checkpoint and its Ray
    processes are killed (-9): the driver ends within the stated bound with one line naming node 1 (its heartbeat
    stopped), the newest checkpoint and checkpoint.resume=auto, and stops rank 0; a worker started again on node 1
    and a resume through Ray continue, and the metrics (steps 1-2 before the loss, 3-4 after) equal a single-host
    2-process run's. The config's relative paths (model.path, trainer.run_dir) name the driver's folders on the
    ranks too, not the folders of Ray's working directory."""
    folders: list[Path] = []
    logs = tmp_path / "logs"
    try:
        head = start_ray(hosts, (0, 1), folders, logs)
        (tmp_path / "model").symlink_to(tiny_model_dir)
        driver = ray_job(hosts, head, tmp_path, settings("model", task, "run", steps=40), logs / "driver-b.log")
        wait_for_checkpoint(tmp_path / "run", 2, driver, logs / "driver-b.log")
        hosts.link_down(1)  # node 1 vanishes without closing its connections, then dies
        hosts.kill_host(1)
        gone = time.time()
        out = ray_finish(driver, logs / "driver-b.log", NODE_TIMEOUT_S + 60)
        took = time.time() - gone
        assert "ray_launch: 2 ranks on 2 node(s), master 10.77.0.1:" in out, out[-4000:]
        newest = CheckpointManager(tmp_path / "run").latest()
        assert newest.step == 2 and verify_checkpoint(newest) == []
        errors = [line for line in out.splitlines() if line.startswith("mcore-rl: error:")]
        assert len(errors) == 1 and errors[0] == last_line(out) and driver.returncode == 1, out[-3000:]
        assert errors[0] == (
            f"mcore-rl: error: node 1 (node1) went away: no heartbeat for {NODE_TIMEOUT_S} s (RUN_DIR/nodes); the "
            f"newest checkpoint is {newest.path}; run launch/ray_launch.py again with checkpoint.resume=auto"
        )
        assert took < NODE_TIMEOUT_S + 30, took  # the stated bound: timeout + a few heartbeats + stopping the job
        assert job_processes(hosts, 0) == []  # rank 0 (hung in a collective) and node 0's beat were stopped
        print(f"the Ray driver ended {took:.1f} s after node 1 went away (MCORE_RL_NODE_TIMEOUT_S={NODE_TIMEOUT_S})")

        hosts.link_up(1)
        start_ray(hosts, (1,), folders, logs)
        resumed = settings("model", task, "run", steps=4, **{"checkpoint.resume": "auto"})
        again = ray_job(hosts, head, tmp_path, resumed, logs / "driver-c.log")
        out = ray_finish(again, logs / "driver-c.log", 300)
        assert again.returncode == 0 and "ray_launch: 2 ranks on 2 node(s), master 10.77.0.1:" in out, out[-4000:]
    finally:
        hosts.close()  # Ray's processes first, then their folders
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)
    rows = metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4], rows
    assert rows == reference


RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}


def start_ray(hosts: TwoHosts, nodes: tuple[int, ...], folders: list[Path], logs: Path) -> subprocess.Popen:
    """A Ray head on node 0, a worker on node 1 (those of `nodes`); the first process started."""
    ray = str(Path(sys.executable).parent / "ray")
    head = [ray, "start", "--head", "--node-ip-address=10.77.0.1", "--port=6379", "--include-dashboard=false"]
    worker = [ray, "start", "--address=10.77.0.1:6379", "--node-ip-address=10.77.0.2"]
    logs.mkdir(exist_ok=True)
    first = None
    for i in nodes:
        # each host its own Ray folder (a short path: Ray's unix sockets live there)
        folders.append(Path(tempfile.mkdtemp(prefix=f"mrl-ray{i}-")))
        cmd = (head, worker)[i] + ["--num-cpus=1", "--disable-usage-stats", "--block", f"--temp-dir={folders[-1]}"]
        log = logs / f"ray{i}-{len(folders)}.log"
        started = hosts.popen(
            i, cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=node_env(i, **RAY_ENV), cwd="/"
        )
        first = first or started
        deadline = time.time() + 180
        while "Ray runtime started" not in log.read_text():
            assert time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
    return first


def ray_job(hosts: TwoHosts, head: subprocess.Popen, cwd: Path, args: list[str], log: Path) -> subprocess.Popen:
    """The Ray driver on node 0 (among the head's processes), in `cwd`."""
    driver = [sys.executable, str(REPO / "launch" / "ray_launch.py"), PRESET, "--address", "10.77.0.1:6379"]
    driver += ["--accelerator", "CPU", "--cpus-per-rank", "1", "--nnodes", "2", "--nproc-per-node", "1", *args]
    env = node_env(0, **RAY_ENV)
    return hosts.join(0, head, driver, str(cwd), stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)


def ray_finish(driver: subprocess.Popen, log: Path, timeout: float) -> str:
    try:
        driver.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the Ray driver did not end within {timeout} s:\n{log.read_text()[-4000:]}") from None
    return log.read_text()


def job_processes(hosts: TwoHosts, i: int, wait_s: float = 15) -> list[str]:
    """The job's actors still alive on host i after `wait_s` (Ray titles a worker by its actor: `ray::RankWorker`)."""
    import psutil

    deadline = time.time() + wait_s
    while True:
        left = []
        for pid in hosts.pids(i):
            try:
                left.append(" ".join(psutil.Process(pid).cmdline()))
            except psutil.Error:
                pass
        left = [line for line in left if "RankWorker" in line or "NodeBeat" in line]
        if not left or time.time() > deadline:
            return left
        time.sleep(0.5)
