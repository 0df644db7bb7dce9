"""k-NN evaluation (cosine, k = 20, T = 0.07) of a frozen encoder.

    python downstream/knn.py --config linear_demo --set init=runs/mpp_demo [--output-dir DIR]
        [--submit slurm|local --gpus-per-node N --time T [--wait]] [--layers all]

--layers all: every block's features from one feature pass, a vote per block; results.md and per_block.png.
"""

import sys

from mpp.commands.knn import main

if __name__ == "__main__":
    sys.exit(main())
