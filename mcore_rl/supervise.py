"""Run a launcher command (torchrun) so that stopping it stops everything it started.

`mcore-rl train` and launch/torchrun_multinode.sh run torchrun through `run_supervised`:
  * the first SIGTERM / SIGINT to this process is passed to every worker that torchrun started; the
    workers stop at the next step boundary (mcore_rl.safety.StopSignals), after any checkpoint they are
    writing is published, and exit; a second SIGINT (Ctrl-C twice) goes to them too and stops them at once
    (mcore_rl.safety.Interrupted), any later signal goes to torchrun, which stops the workers at once;
  * this process is a child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER): whatever torchrun's workers
    leave behind (a process forked to write checkpoint files, an engine's helper) is re-parented here
    instead of to init, and is terminated (then killed) once torchrun has exited;
  * when this process dies (kill -9 included), the job dies with it: torchrun gets SIGKILL from the kernel
    (prctl PR_SET_PDEATHSIG, set in the child before it runs torchrun), each worker gets it when torchrun
    dies, and a reaper in each worker's process group kills what the worker started (`die_with_launcher`),
    so nothing trains, saves or exports unwatched and the run directory's lock is free;
  * a worker that stops the run for a clear reason leaves its one line and exit status in a file
    (`report_to_launcher`): printed here last, after torchrun's output, and returned as this process's
    status (a SIGTERM that reached one rank only still ends the job with 128 + SIGTERM).

    python -m mcore_rl.supervise CMD [ARG ...]      # what launch/torchrun_multinode.sh does
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
LAUNCHER_PID_ENV = "MCORE_RL_LAUNCHER_PID"  # the supervising process's pid, for the workers' reapers
STATUS_DIR_PREFIX = "mcore-rl-status-"  # + the launcher's pid
STATUS_FILE_ENV = "MCORE_RL_STATUS_FILE"  # where a worker leaves its stop / error line for the launcher
REAPER_POLL_S = 0.1  # how soon a reaper sees its worker or the launcher gone


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (Linux >= 3.4); False where unsupported."""
    return _prctl(PR_SET_CHILD_SUBREAPER, 1)


def _killed_with_parent(parent_pid: int):
    """preexec_fn of the launcher's child: the kernel sends it SIGKILL when its parent dies (Linux). The
    signal follows the parent *thread* that forked it: Popen runs on the launcher's main thread, which
    lives as long as the launcher. A parent that died before the prctl took effect is caught by the check.
    libc is loaded here, in the parent: between fork and exec the child must not take the loader's lock."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    sigkill = int(signal.SIGKILL)

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, sigkill, 0, 0, 0) == 0 and os.getppid() != parent_pid:
            os._exit(128 + sigkill)

    return preexec


class ForkedChild:
    """The launcher's child as a fork of this process that runs `target` (what the command would run after its
    interpreter started and imported it), set up as `run_supervised` sets up a command's process: its own session,
    the parent-death signal, `env` as its environment. `mcore-rl train` forks torchrun's agent this way: the
    launcher has imported torch already, a fresh interpreter spent ~1 s importing it again before any worker
    started. The child ends with os._exit (the parent's atexit handlers are the parent's)."""

    def __init__(self, target: Callable[[], int], env: dict):
        preexec = _killed_with_parent(os.getpid())
        sys.stdout.flush()
        sys.stderr.flush()
        self.pid = os.fork()
        self.returncode: Optional[int] = None
        if self.pid == 0:
            self._run_child(target, env, preexec)

    @staticmethod
    def _run_child(target: Callable[[], int], env: dict, preexec) -> None:
        code = 1
        try:
            os.setsid()
            if preexec is not None:
                preexec()
            os.environ.clear()
            os.environ.update(env)
            code = target()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)

    def wait(self) -> int:
        """Its exit status, like Popen.wait (-N for a child that signal N ended)."""
        if self.returncode is None:
            _, status = os.waitpid(self.pid, 0)
            self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, signum)


def _process_start(pid: int) -> Optional[float]:
    """Start time of a live (not zombie) process, None when it is gone: a pid reused later differs in it."""
    import psutil

    try:
        proc = psutil.Process(pid)
        return None if proc.status() == psutil.STATUS_ZOMBIE else proc.create_time()
    except psutil.Error:
        return None


class LauncherWatch:
    """A worker's tie to its launcher (`die_with_launcher`); `release()` on a normal exit."""

    def __init__(self, reaper: Optional[subprocess.Popen] = None):
        self.reaper = reaper

    def release(self) -> None:
        """This worker ends on its own: the reaper leaves its process group alone."""
        if self.reaper is None:
            return
        try:
            self.reaper.stdin.write(b"done\n")
            self.reaper.stdin.close()
        except OSError:
            pass
        self.reaper.wait()
        self.reaper = None


def die_with_launcher() -> LauncherWatch:
    """In a torchrun worker: die as soon as its parent (torchrun's agent) is gone - a kill -9 of `mcore-rl
    train` must not leave the workers training, saving and exporting on their own.

    The kernel's parent-death signal kills this worker at once when torchrun dies (torchrun started it on
    its main thread, and dies itself with the launcher). What the worker started (a reward worker, a
    process forked to write checkpoint files) would live on: a small reaper process in the worker's process
    group (torchrun makes every worker a session leader) kills the whole group once the worker, or the
    launcher (LAUNCHER_PID_ENV), is gone without `release()` having been called."""
    parent = os.getppid()
    _prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if parent <= 1 or os.getppid() != parent:  # torchrun died before the prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    if os.getpgrp() != os.getpid():  # not a group leader: its group holds other processes, leave it
        return LauncherWatch()
    launcher = os.environ.get(LAUNCHER_PID_ENV, "0") or "0"
    code = "import sys; from mcore_rl.supervise import reap_when_gone; reap_when_gone(*map(int, sys.argv[1:]))"
    reaper = subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), launcher], stdin=subprocess.PIPE)
    return LauncherWatch(reaper)


def reap_when_gone(worker: int, launcher: int, interval_s: float = REAPER_POLL_S) -> None:
    """The reaper (a child of `worker`, in its process group): wait for "done" on stdin; when instead the
    worker dies (this process is re-parented) or the launcher does, SIGKILL the group, this process too."""
    import select

    launcher_start = _process_start(launcher) if launcher > 0 else None
    while True:
        ready, _, _ = select.select([sys.stdin.buffer], [], [], interval_s)
        if ready and os.read(sys.stdin.fileno(), 16).startswith(b"done"):
            return
        worker_gone = bool(ready) or os.getppid() != worker  # EOF without "done": the worker is dead
        # a launcher gone before this reaper looked (launcher_start None) is gone too
        launcher_gone = launcher > 0 and (launcher_start is None or _process_start(launcher) != launcher_start)
        if launcher_gone:
            remove_status_dir()
        if worker_gone or launcher_gone:
            os.killpg(os.getpgrp(), signal.SIGKILL)


def remove_orphaned_status_dirs() -> None:
    """Status folders of launchers that died without removing theirs (kill -9): the pid in the name is gone."""
    import psutil

    for folder in Path(tempfile.gettempdir()).glob(f"{_status_dir_prefix()}*-*"):
        pid = folder.name[len(_status_dir_prefix()) :].split("-")[0]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _status_dir_prefix() -> str:
    """mcore-rl-status-<pid namespace>-: pids name processes of this pid namespace only (containers share /tmp)."""
    try:
        space = os.readlink("/proc/self/ns/pid").split("[")[-1].rstrip("]")
    except OSError:
        space = "0"
    return f"{STATUS_DIR_PREFIX}{space}-"


def remove_status_dir() -> None:
    """The launcher is gone (kill -9): its status folder goes with the job (called by the workers' reapers)."""
    path = os.environ.get(STATUS_FILE_ENV, "")
    if Path(path).parent.name.startswith(STATUS_DIR_PREFIX):
        shutil.rmtree(Path(path).parent, ignore_errors=True)


def report_crash(exc: BaseException) -> None:
    """A worker's unexpected exception for the launcher's last line: its last line and where it was raised."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    where = f" ({Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    text = (traceback.format_exception_only(type(exc), exc) or [type(exc).__name__])[-1].strip()
    rank = os.environ.get("RANK", "?")
    report_to_launcher(1, f"mcore-rl: error: rank {rank} failed: {text}{where}", crash=True)


def report_to_launcher(exit_code: int, line: str, crash: bool = False, over_crash: bool = False) -> None:
    """A worker's last word for the launcher (run_supervised): the first rank to report wins; a no-op
    when not started by one. `crash`: an unexpected exception, often the echo of another rank's death (a reset
    connection): a report with `over_crash` (a rank killed by a signal, mcore_rl.torchrun) replaces it."""
    path = os.environ.get(STATUS_FILE_ENV)
    if not path:
        return
    report = {"exit": int(exit_code), "line": line, "crash": crash, "at": time.time()}
    if over_crash and (_read_report(Path(path)) or {}).get("crash"):
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(report, f)
        os.replace(tmp, path)
        return
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:  # another rank reported first (they stop for the same reason), or the launcher is gone
        return
    with os.fdopen(fd, "w") as f:
        json.dump(report, f)


def tell_launcher(exit_code: int, line: str) -> None:
    """A worker's one line: for the launcher to print last (run_supervised), or on stderr once a node when
    started some other way (every rank stops for the same reason)."""
    if os.environ.get(STATUS_FILE_ENV):
        report_to_launcher(exit_code, line)
    elif os.environ.get("LOCAL_RANK", "0") == "0":
        print(line, file=sys.stderr, flush=True)


def _read_report(path: Path) -> Optional[dict]:
    try:
        report = json.loads(path.read_text())
        return report if isinstance(report, dict) and "line" in report else None
    except (OSError, ValueError):
        return None


def reap_descendants(grace_s: float) -> list[int]:
    """Terminate every remaining descendant, kill those still alive after grace_s; their pids."""
    import psutil

    try:
        left = psutil.Process().children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    for proc in left:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in left]


def signal_workers(launcher_pid: int, signum: int) -> bool:
    """Send signum to the launcher's direct children (torchrun's workers) only; False when it has none.

    Not to their process groups, which torchrun's own shutdown would do: helpers of a worker (the
    processes Megatron starts to write checkpoint files, a result-queue manager among them) would die
    mid-write. The workers finish their step and exit; the helpers go with them."""
    import psutil

    try:
        workers = psutil.Process(launcher_pid).children()
    except psutil.NoSuchProcess:
        return False
    for worker in workers:
        try:
            worker.send_signal(signum)
        except psutil.NoSuchProcess:
            pass
    return bool(workers)


def run_supervised(
    cmd: Sequence[str],
    env: Optional[dict] = None,
    grace_s: float = 30.0,
    target: Optional[Callable[[], int]] = None,
    on_start: Optional[Callable[[int], None]] = None,
    explain: Optional[Callable[[Optional[dict], int], Optional[str]]] = None,
) -> int:
    """Run cmd to its end, passing SIGTERM/SIGINT on; then clean up what it left. Its exit status;
    128 + the signal's number when it died of one or was stopped by one passed on from here. With `target`
    (what cmd would run, importable in this process) the child is a fork of this process running it
    (ForkedChild) instead of a new interpreter. `on_start(pid)` gets the child's pid; `explain(report, status)`
    may replace the workers' line printed last (mcore_rl.multinode: a lost node)."""
    become_subreaper()
    remove_orphaned_status_dirs()
    status_dir = Path(tempfile.mkdtemp(prefix=f"{_status_dir_prefix()}{os.getpid()}-"))
    env = dict(os.environ if env is None else env)
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    env[STATUS_FILE_ENV] = str(status_dir / "status.json")
    # Its own session: a Ctrl-C in the terminal reaches torchrun once (from here), not twice.
    if target is not None:
        proc = ForkedChild(target, env)
    else:
        proc = subprocess.Popen(list(cmd), env=env, start_new_session=True, preexec_fn=_killed_with_parent(os.getpid()))

    if on_start is not None:
        on_start(proc.pid)
    received = []
    # Imported before the handlers are set: a second signal arriving while the first one's handler imported it
    # would find it half-initialized (Ctrl-C twice, quickly).
    import psutil  # noqa: F401

    def forward(signum, frame):
        received.append(signum)
        # The first signal, and a second SIGINT (Ctrl-C twice: the workers stop at once), go to the workers only:
        # torchrun would print its own traceback and signal the workers' helpers, which would print theirs.
        if (len(received) == 1 or received == [signal.SIGINT] * 2) and signal_workers(proc.pid, signum):
            return
        try:  # no workers yet, or a later signal: torchrun itself stops them (it signals their process groups)
            proc.send_signal(signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        leftovers = reap_descendants(grace_s)
        if leftovers and (received or proc.returncode):  # after a clean finish these are idle helpers
            print(f"mcore-rl: stopped {len(leftovers)} process(es) left behind by the run", file=sys.stderr)
        report = _read_report(status_dir / "status.json")
        shutil.rmtree(status_dir, ignore_errors=True)
    line = report and report["line"]
    if explain is not None:
        line = explain(report, 128 - code if code < 0 else code)
    if line:  # the workers' reason, last: below torchrun's output and the leftovers line
        print(line, file=sys.stderr, flush=True)
    if received:  # stopped on request: say so in the status, like a process that a signal ended
        return 128 + received[0]
    code = 128 - code if code < 0 else code
    if code == 0 and report is not None:  # e.g. a SIGTERM that reached one rank only: 128 + SIGTERM
        return int(report.get("exit", 0))
    return code


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m mcore_rl.supervise CMD [ARG ...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_supervised(sys.argv[1:]))
