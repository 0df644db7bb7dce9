"""``python -m mpp.demo``: the demo (mpp.tools.demo), under its short name."""

import sys

from mpp.tools.demo import main

if __name__ == "__main__":
    sys.exit(main())
