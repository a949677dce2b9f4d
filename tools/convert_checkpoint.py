"""Thin entry point of the checkpoint converter (the program is `mcore_rl.convert`; see its docstring).

e.g. `torchrun --nproc_per_node 2 tools/convert_checkpoint.py hf-to-mcore --hf M --out C --tp 2`
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mcore_rl.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
