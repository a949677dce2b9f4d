"""torchrun (torch.distributed.run) whose failure report goes to a log file instead of the terminal.

When a worker fails, torchrun prints its own traceback and a ChildFailedError table (exit codes, pids)
below the worker's output, burying the worker's one-line `mcore-rl: error:` under forty lines. Here that
report and torchrun's own log lines are appended to a log file (RUN_DIR/torchrun.log for `mcore-rl
train`), one line names the file, and the exit status is the failed worker's own (the first to fail).
A run that succeeds writes nothing.

    python -m mcore_rl.torchrun LOG_FILE [torchrun arguments ...]
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Sequence

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
        f"mcore-rl: error: rank {rank} (pid {failure.pid}) was killed by {name} and could not say why: the kernel's "
        f"out-of-memory killer (see dmesg), another process, or code running inside it (with reward.timeout_s = 0 "
        f"the reward function runs in the rank's own process: set reward.timeout_s > 0 to give it a worker); "
        f"torchrun's report: {report}; continue with checkpoint.resume=auto",
    )


def main(argv: Sequence[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    log_file, args = Path(argv[0]), list(argv[1:])
    held = _Held()
    for name in _AGENT_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(held)
        logger.propagate = False
    try:
        run(parse_args(args))
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
