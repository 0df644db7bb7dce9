"""Bad data: count it, name it without flooding, and stop when nothing is readable at all
(docs/ARCHITECTURE.md §5.4)."""

from __future__ import annotations

import logging
import time
from collections import deque

log = logging.getLogger(__name__)


class DataError(RuntimeError):
    """No usable data: every recent shard or sample failed. Stops the run with the shards named."""


class SkipLog:
    """The warnings that name bad data: each bad item (a sample key, a shard) once, however often
    it is met again (every epoch reads it); the first ``log_first`` at once, then at most one
    every ``log_every_s`` seconds, with how many were not shown."""

    def __init__(self, log_first: int = 5, log_every_s: float = 10.0):
        self.log_first, self.log_every_s = log_first, log_every_s
        self.named: set[str] = set()
        self._last, self._unshown = 0.0, 0

    def warn(self, name: str, message: str, skipped: int) -> None:
        """Name ``name`` (``message``, with ``skipped``: the count so far) unless named already."""
        if name in self.named:
            return
        now = time.monotonic()
        if len(self.named) < self.log_first or now - self._last >= self.log_every_s:
            extra = f" (+{self._unshown} more not shown)" if self._unshown else ""
            log.warning("%s [%d skipped so far]%s", message, skipped, extra)
            self.named.add(name)
            self._last, self._unshown = now, 0
        else:  # not named yet: a later meeting may name it
            self._unshown += 1


class SkipCounter:
    """Per-process count of skipped bad data, with a named-once, rate-limited log and a
    consecutive-failure guard.

    `skipped` counts events: a sample that fails to decode or has no image, a member or shard
    that cannot be read (a truncated tar is one event; the whole samples before the cut are kept);
    a bad sample met again (the next epoch) counts again. `max_consecutive` bounds failures (and
    shards opened) with no good sample in between, so a training stream over shards that are all
    bad raises instead of spinning forever. ``log_here`` False: the warnings are left in
    ``reports`` for the process that names them (a DataLoader worker's, named by ``Loader``).
    """

    def __init__(
        self,
        max_consecutive: int = 100,
        log_first: int = 5,
        log_every_s: float = 10.0,
        log_here: bool = True,
    ):
        self.skipped = 0
        self.retries = 0  # transient read errors retried (mpp.data.sources)
        self.max_consecutive = max_consecutive
        self.log, self.log_here = SkipLog(log_first, log_every_s), log_here
        self.reports: list[tuple[str, str]] = []  # (name, message), oldest first
        self._read_streak = 0  # shards opened / read errors since the last sample was read
        self._decode_streak = 0  # decode failures since the last sample decoded
        self._recent_urls: deque[str] = deque(maxlen=5)

    def skip(
        self, message: str, url: str | None = None, decode: bool = False, name: str | None = None
    ) -> None:
        """Count one bad item, name it (``name``: the sample key; else ``url``, else the message
        itself) unless named before, raise if too many failed in a row."""
        self.skipped += 1
        if url:
            self._recent_urls.append(url)
        name = name or url or message
        if self.log_here:
            self.log.warn(name, message, self.skipped)
        else:
            self.reports.append((name, message))
        if decode:
            self._decode_streak += 1
        else:
            self._read_streak += 1
        self._check()

    def take_reports(self) -> list[tuple[str, str]]:
        """The (name, message) of the items skipped since the last call (``log_here`` False)."""
        reports, self.reports = self.reports, []
        return reports

    def retried(self, url: str, exn: Exception) -> None:
        """A transient read error that is being retried (object storage): counted, not skipped."""
        self.retries += 1

    def shard_opened(self, url: str) -> None:
        self._recent_urls.append(url)
        self._read_streak += 1
        self._check()

    def sample_read(self) -> None:
        self._read_streak = 0

    def sample_decoded(self) -> None:
        self._decode_streak = 0

    def _check(self) -> None:
        if max(self._read_streak, self._decode_streak) > self.max_consecutive:
            # the error ends this process's batches: what it has not handed on is named here
            first = self.skipped - len(self.reports) + 1
            for n, (name, message) in enumerate(self.take_reports(), first):
                self.log.warn(name, message, n)
            urls = ", ".join(dict.fromkeys(self._recent_urls))
            raise DataError(
                f"{self.max_consecutive} consecutive data failures with no good sample "
                f"({self.skipped} skipped in total); are all shards bad or empty? recent shards: {urls}"
            )
