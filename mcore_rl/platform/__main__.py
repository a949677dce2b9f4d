"""`python -m mcore_rl.platform env PLATFORM`: print `export K=V` lines of the environment that PLATFORM
(cpu | cuda | npu) needs (mcore_rl.platform.ASCEND_ENV for npu; values already set are kept), for launchers:
    eval "$(python -m mcore_rl.platform env npu)"
"""

import shlex
import sys

from mcore_rl.platform import PLATFORMS, Platform


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "env" or argv[1] not in PLATFORMS:
        print(f"usage: python -m mcore_rl.platform env {{{'|'.join(PLATFORMS)}}}", file=sys.stderr)
        return 2
    for key, value in Platform(argv[1]).apply_environment().items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
