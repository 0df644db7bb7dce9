"""Other libraries' chatter kept off stdout, unless ``--verbose`` or ``MPP_VERBOSE=1``
(docs/pretraining.md). Cheap to import: ``mpp/__init__.py`` installs the log filter before
DeepSpeed is imported."""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
from collections.abc import Iterator

VERBOSE = "MPP_VERBOSE"


def verbose() -> bool:
    """Whether other libraries' chatter is asked for (``--verbose``, ``MPP_VERBOSE=1``)."""
    return os.environ.get(VERBOSE, "") not in ("", "0")


def _deepspeed_chatter(record: logging.LogRecord) -> bool:
    """False for a DeepSpeed record that only chatters: below a warning (its engine and its
    launcher lower the logger to INFO when asked), or the warning each process on a machine
    without a GPU prints when it imports DeepSpeed."""
    if verbose():
        return True
    if record.levelno < logging.WARNING:
        return False
    return not record.getMessage().startswith("Setting accelerator to CPU")


def hush_deepspeed_log() -> None:
    """The filter on DeepSpeed's logger ("DeepSpeed", stdout), installed once. A filter rather
    than a level: DeepSpeed sets its logger's level when it creates it, and again from a config's
    ``log_level``; the logger object, and with it the filter, stays."""
    logger = logging.getLogger("DeepSpeed")
    if _deepspeed_chatter not in logger.filters:
        logger.addFilter(_deepspeed_chatter)


@contextlib.contextmanager
def hushed_prints() -> Iterator[None]:
    """Within it, prints to stdout are dropped unless verbose (a library that ``print``s)."""
    if verbose():
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()):
        yield


class _Verbose(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        os.environ[VERBOSE] = "1"  # read where the chatter happens, and by a launcher's ranks
        setattr(namespace, self.dest, True)


def add_verbose_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--verbose",
        nargs=0,
        action=_Verbose,
        default=False,
        help="DeepSpeed's own log lines and its checkpoint converter's prints too (as "
        "MPP_VERBOSE=1 does)",
    )
