"""``mpp knn`` (``downstream/knn.py``): the k-NN evaluation of a frozen encoder
(mpp.transfer.probe_cli)."""

import sys

from mpp.commands.job import probe_main


def main(argv: list[str] | None = None) -> int:
    return probe_main("knn", argv)


if __name__ == "__main__":
    sys.exit(main())
