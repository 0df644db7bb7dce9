"""``python -m mpp.export``: weights out (mpp.hub.export), under its short name."""

import sys

from mpp.hub.export import main

if __name__ == "__main__":
    sys.exit(main())
