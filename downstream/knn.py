"""k-NN evaluation (cosine, k = 20, T = 0.07) of a frozen encoder.

    python downstream/knn.py --config linear_demo --set init=runs/mpp_demo [--output-dir DIR]
"""

import sys

from mpp.probe import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("knn"))
