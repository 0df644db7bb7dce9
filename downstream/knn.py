"""k-NN evaluation (cosine, k = 20, T = 0.07) of a frozen encoder.

    python downstream/knn.py --config linear_demo --set init=runs/mpp_demo [--output-dir DIR] [--layers all]

--layers all: every block's features from one feature pass, a vote per block; results.md and per_block.png.
"""

import sys

from mpp.probe_cli import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("knn"))
