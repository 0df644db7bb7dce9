"""Plan a GPU run on the CPU: memory per GPU, step-time bounds, communication and the recipe
of CONFIG on N GPUs, from the real objective's step on fake tensors (nothing is allocated).

    mpp plan mae_b16 --gpus 8                  (or python -m mpp.tools.planner ...)
    mpp plan hpm_b16 --gpus 64 --gpu h100 --out plan.json
"""

from __future__ import annotations

import argparse
import sys

from mpp.cli import add_set_argument
from mpp.tools.planner.cli import add_plan_arguments, plan_main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="mpp plan",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("config", help="a JSON file, or a name in configs/ (mae_b16, ...)")
    add_set_argument(p)
    add_plan_arguments(p)
    args = p.parse_args(argv)
    return plan_main(args.config, args.set, args.gpus, args.gpu, args.out)


if __name__ == "__main__":
    sys.exit(main())
