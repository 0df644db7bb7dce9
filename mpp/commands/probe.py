"""``mpp probe`` (``downstream/linear_probe.py``): the linear probe of a frozen encoder
(mpp.transfer.probe_cli)."""

import sys

from mpp.transfer.probe_cli import run_probe


def main(argv: list[str] | None = None) -> int:
    return run_probe("linear", argv)


if __name__ == "__main__":
    sys.exit(main())
