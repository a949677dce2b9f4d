"""Run a launcher command (torchrun) so that stopping it stops everything it started.

`mcore-rl train` and launch/torchrun_multinode.sh run torchrun through `run_supervised`:
  * the first SIGTERM / SIGINT to this process is passed to every worker that torchrun started; the
    workers stop at the next step boundary (mcore_rl.safety.StopSignals), after any checkpoint they are
    writing is published, and exit; a second one goes to torchrun, which stops the workers at once;
  * this process is a child subreaper (Linux prctl PR_SET_CHILD_SUBREAPER): whatever torchrun's workers
    leave behind (a process forked to write checkpoint files, an engine's helper) is re-parented here
    instead of to init, and is terminated (then killed) once torchrun has exited.

    python -m mcore_rl.supervise CMD [ARG ...]      # what launch/torchrun_multinode.sh does
"""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
from typing import Optional, Sequence

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process (Linux >= 3.4); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


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


def run_supervised(cmd: Sequence[str], env: Optional[dict] = None, grace_s: float = 30.0) -> int:
    """Run cmd to its end, passing SIGTERM/SIGINT on; then clean up what it left. Its exit status;
    128 + the signal's number when it died of one or was stopped by one passed on from here."""
    become_subreaper()
    # Its own session: a Ctrl-C in the terminal reaches torchrun once (from here), not twice.
    proc = subprocess.Popen(list(cmd), env=env, start_new_session=True)

    received = []

    def forward(signum, frame):
        received.append(signum)
        if len(received) == 1 and signal_workers(proc.pid, signum):
            return
        try:  # no workers yet, or a second signal: torchrun itself stops them (it signals their process groups)
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
    if received:  # stopped on request: say so in the status, like a process that a signal ended
        return 128 + received[0]
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m mcore_rl.supervise CMD [ARG ...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(run_supervised(sys.argv[1:]))
