"""Masking ablations and the reference results (``mpp ablate``): a grid of overrides x seeds,
each cell pretrained through the deepspeed launcher and evaluated; results.csv, results.md and
results.png. ``python pretrain/ablate.py --help`` (mpp.commands.ablate) says more.
"""

import sys

from mpp.commands.ablate import main, parse_args, split_values  # noqa: F401  (their names, kept)

if __name__ == "__main__":
    sys.exit(main())
