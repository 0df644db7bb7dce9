"""Bad data: count it, log it without flooding, and stop when nothing is readable at all.

webdataset's `warn_and_continue` sleeps 0.5 s per bad sample; this handler only counts.
"""

from __future__ import annotations

import logging
import time
from collections import deque

log = logging.getLogger(__name__)


class DataError(RuntimeError):
    """No usable data: every recent shard or sample failed. Stops the run with the shards named."""


class SkipCounter:
    """Per-process count of skipped bad data, with a rate-limited log and a consecutive-failure guard.

    `skipped` counts events: a sample that fails to decode or has no image, a member or shard
    that cannot be read (a truncated tar is one event; the whole samples before the cut are kept).
    `max_consecutive` bounds failures (and shards opened) with no good sample in between, so a
    training stream over shards that are all bad raises instead of spinning forever.
    """

    def __init__(self, max_consecutive: int = 100, log_first: int = 5, log_every_s: float = 10.0):
        self.skipped = 0
        self.retries = 0  # transient read errors retried (mpp.data.sources)
        self.max_consecutive = max_consecutive
        self.log_first, self.log_every_s = log_first, log_every_s
        self._last_log, self._unlogged = 0.0, 0
        self._read_streak = 0  # shards opened / read errors since the last sample was read
        self._decode_streak = 0  # decode failures since the last sample decoded
        self._recent_urls: deque[str] = deque(maxlen=5)

    def skip(self, message: str, url: str | None = None, decode: bool = False) -> None:
        """Count one bad item, log it (rate-limited), raise if too many failed in a row."""
        self.skipped += 1
        if url:
            self._recent_urls.append(url)
        self._log(message)
        if decode:
            self._decode_streak += 1
        else:
            self._read_streak += 1
        self._check()

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
            urls = ", ".join(dict.fromkeys(self._recent_urls))
            raise DataError(
                f"{self.max_consecutive} consecutive data failures with no good sample "
                f"({self.skipped} skipped in total); are all shards bad or empty? recent shards: {urls}"
            )

    def _log(self, message: str) -> None:
        now = time.monotonic()
        if self.skipped <= self.log_first or now - self._last_log >= self.log_every_s:
            extra = f" (+{self._unlogged} more not shown)" if self._unlogged else ""
            log.warning("%s [%d skipped so far]%s", message, self.skipped, extra)
            self._last_log, self._unlogged = now, 0
        else:
            self._unlogged += 1
