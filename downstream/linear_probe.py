"""Linear probe (BatchNorm without affine + Linear, SGD) of a frozen encoder.

    python downstream/linear_probe.py --config linear_demo --set init=runs/mpp_demo [--output-dir DIR]
"""

import sys

from mpp.probe import run_probe

if __name__ == "__main__":
    sys.exit(run_probe("linear"))
