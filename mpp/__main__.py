import sys

from mpp.commands import main

if __name__ == "__main__":
    sys.exit(main())
