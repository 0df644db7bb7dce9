"""``python -m mpp``: the ``mpp`` command (mpp.commands)."""

import sys

from mpp.commands import main

if __name__ == "__main__":
    sys.exit(main())
