"""torchrun (torch.distributed.run) whose failure report goes to a log file instead of the terminal.

When a worker fails, torchrun prints its own traceback and a ChildFailedError table (exit codes, pids)
below the worker's output, burying the worker's one-line `mcore-rl: error:` under forty lines. Here that
report and torchrun's own log lines are appended to a log file (RUN_DIR/torchrun.log for `mcore-rl
train`), one line names the file, and the exit status is the failed worker's own (the first to fail).
A run that succeeds writes nothing.

    python -m mcore_rl.torchrun LOG_FILE [torchrun arguments ...]

`mcore-rl train` runs the agent in a fork of itself and has it fork the workers too (`main(..., worker=...)`):
each worker then starts with torch, transformers and the input check's modules imported, as the launcher has them;
a fresh `python -m mcore_rl.cli` spent ~1.8 s of CPU per rank importing them again. `ForkedWorker` sets the fork up
as torchrun sets up a worker's process (its own session, the signals' default actions, line-buffered output, the
environment's thread count) and exits with the status the command would have.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Optional, Sequence

# torchrun's agent logs (worker exits, "Sending process N closing signal") under these loggers
_AGENT_LOGGERS = ("torch.distributed.run", "torch.distributed.elastic", "torch.distributed.launcher")


class _Held(logging.Handler):
    """Keeps the agent's log records until the run ends (into the log file on failure, else dropped)."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))


def _write_log(log_file: Path, text: str) -> Path:
    """Append to log_file; to a file in the temp directory when that is not writable."""
    header = f"===== {time.strftime('%Y-%m-%d %H:%M:%S')} torchrun reported a failed worker =====\n"
    for target in (log_file, Path(tempfile.gettempdir()) / f"mcore-rl-{log_file.name}"):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "a") as f:
                f.write(header + text + "\n")
            return target
        except OSError:
            continue
    return log_file


def failed_exit_code(error) -> int:
    """The first failed worker's exit status (128 + signal for one that a signal ended)."""
    _, failure = error.get_first_failure()
    code = failure.exitcode
    return 128 - code if code < 0 else (code or 1)


ACTOR_RANKS_ENV = "MCORE_RL_ACTOR_RANKS"  # set by `mcore-rl train` for rollout.placement=separate


def rank_role(rank: int) -> str:
    """`rank N`, or in a separate-placement job `actor rank N` / `rollout rank N` (global ranks >= the actor's)."""
    actors = os.environ.get(ACTOR_RANKS_ENV, "")
    if not actors.isdigit():
        return f"rank {rank}"
    return f"{'actor' if rank < int(actors) else 'rollout'} rank {rank}"


def report_signal_death(error, report: Path) -> None:
    """A worker that a signal ended (SIGKILL) says nothing itself: name the rank, the signal and the likely
    causes for the launcher (supervise.report_to_launcher; a worker's own line, when there is one, wins)."""
    import signal

    from mcore_rl.supervise import report_to_launcher

    rank, failure = error.get_first_failure()
    if failure.exitcode >= 0:
        return
    try:
        name = signal.Signals(-failure.exitcode).name
    except ValueError:
        name = f"signal {-failure.exitcode}"
    report_to_launcher(
        128 - failure.exitcode,
        f"mcore-rl: error: {rank_role(rank)} (pid {failure.pid}) was killed by {name} and could not say why: the kernel's "
        f"out-of-memory killer (see dmesg), another process, or code running inside it (with reward.timeout_s = 0 "
        f"the reward function runs in the rank's own process: set reward.timeout_s > 0 to give it a worker); "
        f"torchrun's report: {report}; continue with checkpoint.resume=auto",
        over_crash=True,  # the other ranks' errors (a reset connection) follow from this death
    )


class ForkedWorker:
    """torchrun's worker as a fork of the agent that runs `main(args)` (what `python -u -m MODULE ARGS` would run
    once its interpreter had imported MODULE); torchrun passes it the command's arguments (-u -m MODULE ARGS)."""

    def __init__(self, main: Callable[[list[str]], int]):
        self.main = main
        self.__name__ = self.__qualname__ = "mcore_rl.torchrun.ForkedWorker"  # torchrun's logs name its entrypoint

    def __call__(self, *cmd_args: str) -> None:
        os.setsid()  # as torchrun starts a command: its own session (supervise.die_with_launcher's reaper needs it)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):  # the agent's handlers are the agent's
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for stream in (sys.stdout, sys.stderr):  # python -u: each line out as it is written
            if hasattr(stream, "reconfigure"):
                stream.reconfigure(line_buffering=True)
        threads = os.environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # a fresh interpreter reads it at start; this one started earlier
            import torch

            torch.set_num_threads(int(threads))
        args = list(cmd_args)
        if args[:1] == ["-u"]:
            args = args[1:]
        if args[:1] == ["-m"]:
            args = args[2:]
        real_exit = os._exit
        os._exit = _reporting_exit(real_exit, _return_queue())
        try:
            code = self.main(args)
        except KeyboardInterrupt:  # as an interpreter ends on one (torch's wrapper would report success)
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            raise
        finally:
            os._exit = real_exit
        if code:
            sys.exit(code)


def _return_queue():
    """torch's queue for this forked worker's return value: `ret_val_` of the frame that called the entrypoint
    (torch.distributed.elastic.multiprocessing.api._wrap); None where torch names it otherwise."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_wrap" and "ret_val_" in frame.f_locals:
            return frame.f_locals["ret_val_"]
        frame = frame.f_back
    return None


def _reporting_exit(real_exit: Callable[[int], None], queue) -> Callable[[int], None]:
    """os._exit for a forked worker: torch's agent counts a forked worker done by the return value it puts on
    `queue`, and waits forever for one that ended with status 0 without it (the trainer's Ctrl-C-twice stop ends
    with os._exit(0)); a fresh interpreter's agent goes by the exit status alone."""

    def exit_now(status: int) -> None:
        if status == 0 and queue is not None:
            queue.put(None)
        real_exit(status)

    return exit_now


def _run_forked(args, worker: ForkedWorker) -> None:
    """torch.distributed.run.run for `--standalone` with the workers forked from this process (`worker`)."""
    import uuid

    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    if not args.standalone:
        raise ValueError("forked workers: only a --standalone launch (one machine) is supported")
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, cmd_args = config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config=config, entrypoint=worker)(*cmd_args)


def main(argv: Sequence[str], worker: Optional[ForkedWorker] = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    log_file, args = Path(argv[0]), list(argv[1:])
    held = _Held()
    for name in _AGENT_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(held)
        logger.propagate = False
    try:
        if worker is None:
            run(parse_args(args))
        else:
            _run_forked(parse_args(args), worker)
    except ChildFailedError as e:
        text = "\n".join(held.lines + [traceback.format_exc()])
        path = _write_log(log_file, text)
        print(f"mcore-rl: a worker failed; torchrun's report (exit codes, pids): {path}", file=sys.stderr, flush=True)
        report_signal_death(e, path)
        return failed_exit_code(e)
    except BaseException:  # not a worker's failure (rendezvous, a signal to torchrun): show its log as usual
        print("\n".join(held.lines), file=sys.stderr, flush=True)
        raise
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -m mcore_rl.torchrun LOG_FILE [torchrun arguments ...]", file=sys.stderr)
        sys.exit(2)
    sys.exit(main(sys.argv[1:]))
