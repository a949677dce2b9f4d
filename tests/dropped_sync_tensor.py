"""`mcore-rl train` in which one rank's embedded engine leaves one tensor of one sync unapplied: an in-place load that
went wrong on the receiving side (tests/test_placement_e2e.py: the verification and rebuild across the split).

    python tests/dropped_sync_tensor.py --rank R --tensor NAME --arrival K -- train CONFIG [key=value ...]

The launcher patches `EmbeddedEngine.load_weights` before it starts torchrun. On CPU torchrun's ranks are forks of the
launcher (mcore_rl/torchrun.py), so every rank holds the patch; it acts in global rank R only, where the K-th arrival
of the tensor NAME is skipped (the rest of its bucket is loaded). A rank started as a fresh interpreter would not
hold the patch: the run would then show no failed verification, and the test fails.
"""

import argparse
import os
import sys


def drop_one_tensor(rank: int, tensor: str, arrival: int) -> None:
    from mcore_rl.rollout.embedded import EmbeddedEngine

    load = EmbeddedEngine.load_weights
    seen = []

    def load_weights(self, weights):
        if os.environ.get("RANK") != str(rank):
            return load(self, weights)
        kept = []
        for name, value in weights:
            if name == tensor:
                seen.append(name)
                if len(seen) == arrival:
                    print(f"dropped_sync_tensor: rank {rank} left {name} (arrival {arrival}) out", flush=True)
                    continue
            kept.append((name, value))
        return load(self, kept)

    EmbeddedEngine.load_weights = load_weights


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--tensor", required=True)
    parser.add_argument("--arrival", type=int, required=True)
    parser.add_argument("cli", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    drop_one_tensor(args.rank, args.tensor, args.arrival)
    from mcore_rl.cli import main as cli_main

    return cli_main(args.cli[1:] if args.cli[:1] == ["--"] else args.cli)


if __name__ == "__main__":
    sys.exit(main())
