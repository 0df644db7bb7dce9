"""Linear probe of a frozen encoder; README "Probe protocols" says which paper each reproduces.

    python downstream/linear_probe.py --config linear_demo --set init=runs/mpp_demo [--output-dir DIR]
        [--submit slurm|local --gpus-per-node N --time T [--wait]]
        [--protocol fast|mae|dinov2] [--layers last|all]

fast (default): BatchNorm without affine + Linear, SGD, on cached center-crop features.
mae: MAE's (BatchNorm + LARS, images augmented on the fly through the frozen encoder).
dinov2: DINOv2's grid of learning rates x last 1/4 blocks x cls/cls+avg, trained in one pass.
--layers all: a head per block, one feature pass; results.md and per_block.png.
"""

import sys

from mpp.commands.probe import main

if __name__ == "__main__":
    sys.exit(main())
