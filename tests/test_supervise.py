"""Stopping a run: SIGTERM/SIGINT reach every worker (which stop at a safe point), and nothing the run
started outlives it. Real processes; the trainer's side runs in tests/test_trainer_e2e.py::test_sigterm_*."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mcore_rl.safety import StopSignals

# A stand-in for a torchrun worker: starts a helper that ignores SIGTERM and would run forever (like a
# process forked to write checkpoint files), then stops cleanly when it is signalled itself.
WORKER = """
import os, signal, subprocess, sys, time
out, i = sys.argv[1], sys.argv[2]
code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
helper = subprocess.Popen([sys.executable, "-c", code])
open(os.path.join(out, f"helper{i}"), "w").write(str(helper.pid))
stop = []
signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
open(os.path.join(out, f"ready{i}"), "w").write("")
while not stop:
    time.sleep(0.05)
open(os.path.join(out, f"stopped{i}"), "w").write(str(stop[0]))
"""

# A stand-in for torchrun: two workers, each in its own session (as torchrun starts them).
FAKE_LAUNCHER = """
import subprocess, sys
out, worker = sys.argv[1], sys.argv[2]
procs = [subprocess.Popen([sys.executable, "-c", worker, out, str(i)], start_new_session=True) for i in range(2)]
sys.exit(max(p.wait() for p in procs))
"""


def test_sigterm_reaches_every_worker_and_leftovers_are_stopped(tmp_path):
    code = f"from mcore_rl.supervise import run_supervised; import sys; sys.exit(run_supervised({[sys.executable, '-c', FAKE_LAUNCHER, str(tmp_path), WORKER]!r}, grace_s=2))"
    sup = subprocess.Popen([sys.executable, "-c", code], cwd=os.getcwd())
    deadline = time.time() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.time() < deadline and sup.poll() is None, "workers did not start"
        time.sleep(0.05)
    helpers = [int((tmp_path / f"helper{i}").read_text()) for i in range(2)]
    sup.send_signal(signal.SIGTERM)
    assert sup.wait(timeout=60) == 128 + signal.SIGTERM
    for i in range(2):  # each worker got the signal itself and stopped on its own
        assert (tmp_path / f"stopped{i}").read_text() == str(int(signal.SIGTERM))
    for pid in helpers:  # orphaned helpers that ignore SIGTERM were re-parented to the supervisor and killed
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# A stand-in for a torchrun worker that ties itself to its launcher, starts a long-lived helper (like a
# reward worker) and then trains forever.
TIED_WORKER = """
import os, subprocess, sys, time
from mcore_rl.supervise import die_with_launcher
out, i = sys.argv[1], sys.argv[2]
watch = die_with_launcher()
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.path.join(out, f"helper{i}"), "w").write(str(helper.pid))
open(os.path.join(out, "status"), "w").write(os.environ["MCORE_RL_STATUS_FILE"])
open(os.path.join(out, f"ready{i}"), "w").write(str(os.getpid()))
while True:
    time.sleep(0.05)
"""


def test_kill_9_of_the_launcher_takes_torchrun_the_workers_and_their_helpers(tmp_path):
    """The launcher's death (kill -9: no handler runs) used to leave the job running unwatched: torchrun
    dies with it (parent-death signal), each worker with torchrun, and each worker's reaper kills what it started."""
    code = f"from mcore_rl.supervise import run_supervised; import sys; sys.exit(run_supervised({[sys.executable, '-c', FAKE_LAUNCHER, str(tmp_path), TIED_WORKER]!r}, grace_s=2))"
    sup = subprocess.Popen([sys.executable, "-c", code], cwd=os.getcwd())
    deadline = time.time() + 60
    while not all((tmp_path / f"ready{i}").exists() for i in range(2)):
        assert time.time() < deadline and sup.poll() is None, "workers did not start"
        time.sleep(0.05)
    started = psutil.Process(sup.pid).children(recursive=True)
    pids = {p.pid for p in started}
    helpers = [int((tmp_path / f"helper{i}").read_text()) for i in range(2)]
    assert set(helpers) <= pids and len(started) >= 7  # torchrun, 2 workers, 2 reapers, 2 helpers
    status_dir = Path((tmp_path / "status").read_text()).parent
    assert status_dir.is_dir() and status_dir.name.startswith("mcore-rl-status-")
    sup.send_signal(signal.SIGKILL)
    sup.wait()
    try:
        _, alive = psutil.wait_procs(started, timeout=10)
        assert not alive, [(p.pid, p.cmdline()[:3]) for p in alive]
        assert not status_dir.exists()  # the launcher's status folder went with the job (the workers' reapers)
    finally:
        for proc in started:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass


ENDING_WORKER = """
import subprocess, sys
from mcore_rl.supervise import die_with_launcher
watch = die_with_launcher()
quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # the test reads this worker's output to its end
helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], **quiet)
print(watch.reaper.pid, helper.pid, flush=True)
watch.release()
"""


def test_a_worker_that_ends_on_its_own_is_left_to_the_launcher(tmp_path):
    """release(): the reaper exits and leaves the group alone (leftovers after a clean end are the
    launcher's to stop, after their grace period), unlike after a kill."""
    proc = subprocess.run(
        [sys.executable, "-c", ENDING_WORKER], capture_output=True, text=True, start_new_session=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    reaper, helper = map(int, proc.stdout.split())
    try:
        time.sleep(1)
        assert not psutil.pid_exists(reaper) or psutil.Process(reaper).status() == psutil.STATUS_ZOMBIE
        assert psutil.Process(helper).status() != psutil.STATUS_ZOMBIE  # not killed by the reaper
    finally:
        os.kill(helper, signal.SIGKILL)


def test_stop_signals_record_the_first_and_a_second_ctrl_c_interrupts():
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    stop = StopSignals()
    try:
        stop.install()
        assert stop.agreed() is None
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)
        assert stop.agreed() == "SIGINT"
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.1)
            raise AssertionError("a second SIGINT must interrupt")
        except KeyboardInterrupt:
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_stop_file_asks_like_a_signal(tmp_path):
    """The Ray launcher's way to stop the ranks (they may run outside a main thread): RUN_DIR/STOP."""
    stop = StopSignals(tmp_path / "STOP")
    assert stop.agreed() is None
    (tmp_path / "STOP").write_text("SIGTERM to ray_launch\n")
    assert stop.agreed() == str(tmp_path / "STOP")


FORKED = """
import json, os, sys
from mcore_rl.supervise import run_supervised

out, launcher = sys.argv[1], os.getpid()


def target():  # runs in the fork: its own session, the given environment, the launcher as its parent
    seen = {"session_leader": os.getsid(0) == os.getpid(), "env": os.environ.get("FORK_CHECK"), "parent": os.getppid() == launcher}
    open(out, "w").write(json.dumps(seen))
    return 3


sys.exit(run_supervised(["unused"], env=dict(os.environ, FORK_CHECK="yes"), target=target))
"""


def test_a_forked_child_is_set_up_like_the_command_and_its_status_returned(tmp_path):
    """`mcore-rl train` forks torchrun's agent (ForkedChild) instead of starting an interpreter for it: the fork
    gets the command's set-up (own session, environment) and its exit status is the launcher's."""
    import json

    out = tmp_path / "seen.json"
    proc = subprocess.run([sys.executable, "-c", FORKED, str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert json.loads(out.read_text()) == {"session_leader": True, "env": "yes", "parent": True}


FORKED_WORKERS = """
import json, os, signal, sys, types
import torch
from mcore_rl import torchrun

out, agent = sys.argv[1], os.getpid()
sys.modules["made_by_the_launcher"] = types.ModuleType("made_by_the_launcher")  # only a fork has it
torch.set_num_threads(2)  # the launcher's count; the workers' environment says 1
os.environ["OMP_NUM_THREADS"] = "1"


def worker(argv):  # torchrun's rank, forked from this process
    rank = int(os.environ["RANK"])
    seen = {
        "argv": argv,
        "forked": "made_by_the_launcher" in sys.modules,
        "session_leader": os.getsid(0) == os.getpid(),
        "threads": torch.get_num_threads(),
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "world": os.environ["WORLD_SIZE"],
    }
    open(os.path.join(out, f"rank{rank}.json"), "w").write(json.dumps(seen))
    if sys.argv[2] == "fail" and rank == 1:
        return 3
    if rank == 1:  # as the trainer's Ctrl-C-twice stop ends: torch's agent must not wait for it forever
        os._exit(0)
    return 0


log = os.path.join(out, "torchrun.log")
args = [log, "--standalone", "--nproc_per_node=2", "-m", "some.module", "train", "cfg.yaml"]
sys.exit(torchrun.main(args, worker=torchrun.ForkedWorker(worker)))
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["ok", "fail"])
def test_forked_workers_are_set_up_like_torchruns_command_and_end_with_its_status(tmp_path, case):
    """On CPU `mcore-rl train` has torchrun's agent fork the ranks (torchrun.ForkedWorker) instead of starting
    interpreters: each gets the command's arguments, its own session, the default SIGTERM action and the
    environment's thread count; a rank that ends with os._exit(0) does not leave the agent waiting, and a rank's
    failure is the agent's exit status (with torchrun's report in the log file)."""
    import json

    proc = subprocess.run(
        [sys.executable, "-c", FORKED_WORKERS, str(tmp_path), case], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == (3 if case == "fail" else 0), proc.stderr[-3000:]
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert seen == {
            "argv": ["train", "cfg.yaml"],
            "forked": True,
            "session_leader": True,
            "threads": 1,
            "sigterm_default": True,
            "world": "2",
        }, seen
    assert (tmp_path / "torchrun.log").is_file() == (case == "fail")


def test_a_rank_killed_by_a_signal_replaces_the_crash_it_caused(tmp_path, monkeypatch):
    """A rank's unexpected exception is often the echo of another rank's death (a reset connection): the death's
    line (mcore_rl.torchrun.report_signal_death) replaces a crash report, never a clear one; the first clear one wins."""
    import json

    from mcore_rl import supervise

    for first, crash, expected in ((("reset by peer", 1), True, "killed"), (("disk full", 1), False, "disk full")):
        status = tmp_path / f"{expected.replace(' ', '_')}.json"
        monkeypatch.setenv(supervise.STATUS_FILE_ENV, str(status))
        supervise.report_to_launcher(first[1], first[0], crash=crash)
        supervise.report_to_launcher(137, "killed", over_crash=True)
        supervise.report_to_launcher(1, "later")
        assert json.loads(status.read_text())["line"] == expected
