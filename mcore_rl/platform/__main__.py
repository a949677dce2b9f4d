"""`python -m mcore_rl.platform env PLATFORM [CONFIG [key=value ...]]`: print `export K=V` lines of the environment
that PLATFORM (cpu | cuda | npu) needs (mcore_rl/platform/ascend_env.py for npu; values already set are kept); with
CONFIG also what the run's config decides (HCCL_EXEC_TIMEOUT, TASK_QUEUE_ENABLE, trainer.deterministic), for
launchers:
    eval "$(python -m mcore_rl.platform env npu CONFIG key=value ...)"
"""

import shlex
import sys

from mcore_rl.platform import PLATFORMS, Platform, RunEnvironment


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "env" or argv[1] not in PLATFORMS:
        print(
            f"usage: python -m mcore_rl.platform env {{{'|'.join(PLATFORMS)}}} [CONFIG [key=value ...]]",
            file=sys.stderr,
        )
        return 2
    run = None
    if len(argv) > 2:
        from mcore_rl.config import ConfigError, load_config

        try:
            run = RunEnvironment.of(load_config(argv[2], argv[3:]))
        except ConfigError as e:
            print(f"mcore-rl: error: {e}", file=sys.stderr)
            return 2
    for key, value in Platform(argv[1]).apply_environment(run=run).items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
