"""``mpp probe`` (``downstream/linear_probe.py``): the linear probe of a frozen encoder
(mpp.transfer.probe_cli)."""

import sys

from mpp.commands.job import probe_main


def main(argv: list[str] | None = None) -> int:
    return probe_main("linear", argv)


if __name__ == "__main__":
    sys.exit(main())
