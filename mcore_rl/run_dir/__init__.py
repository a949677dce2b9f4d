"""Run directory and crash-safe checkpoints: one job a module.

`layout` names the files of a run directory and writes them crash-safely; `checkpoints` publishes and prunes
checkpoints and picks the one to resume from; `checksums` hashes and verifies their files; `errors` says why a
write failed; `ownership` keeps one run per run directory (its lock, another run's checkpoints) and is the
pre-flight check of the directory; `trainer_state` writes and reads each rank's trainer state and checks that
nothing a checkpoint unpickles can run code. The names below are the package's interface.
"""

from mcore_rl.run_dir.checkpoints import (
    CheckpointManager,
    resolve_resume,
    resolve_resume_checked,
    resolve_verified_resume,
)
from mcore_rl.run_dir.checksums import (
    TRUST_FLAG,
    file_crc32,
    file_owner,
    file_problem,
    unverifiable,
    verify_checkpoint,
)
from mcore_rl.run_dir.errors import CheckpointWriteError, OutputWriteError, write_failure
from mcore_rl.run_dir.layout import (
    ABANDONED,
    CHECKSUMS,
    LOCK_FILE,
    MARKER,
    POINTER,
    PREVIOUS_RUNS,
    Checkpoint,
    is_complete,
)
from mcore_rl.run_dir.ownership import (
    RunLock,
    abandon_newer,
    check_lock_free,
    check_run_dir,
    claim_run_dir,
    claim_run_dir_collective,
    move_old_run,
    ownership_problem,
)
from mcore_rl.run_dir.trainer_state import (
    TRUST_PICKLE,
    check_pickles,
    read_state,
    rng_state,
    set_rng_state,
    state_file,
)

__all__ = [
    "ABANDONED",
    "CHECKSUMS",
    "LOCK_FILE",
    "MARKER",
    "POINTER",
    "PREVIOUS_RUNS",
    "TRUST_FLAG",
    "TRUST_PICKLE",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointWriteError",
    "OutputWriteError",
    "RunLock",
    "abandon_newer",
    "check_lock_free",
    "check_run_dir",
    "check_pickles",
    "claim_run_dir",
    "claim_run_dir_collective",
    "file_crc32",
    "file_owner",
    "file_problem",
    "is_complete",
    "move_old_run",
    "ownership_problem",
    "read_state",
    "resolve_resume",
    "resolve_resume_checked",
    "resolve_verified_resume",
    "rng_state",
    "set_rng_state",
    "state_file",
    "unverifiable",
    "verify_checkpoint",
    "write_failure",
]
