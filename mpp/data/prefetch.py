"""The next batches made ready while the step runs: a thread ``prepare``s them (the copy to the
device, the GPU's decode, normalisation) on a stream of its own and hands each over with an
event, as timm's ``PrefetchLoader`` does the copy (docs/ARCHITECTURE.md §3.5). An error in the
loader or in ``prepare`` is raised in the training thread; leaving the ``with`` stops the thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator

import torch

_END = object()


class Prefetcher:
    """``prepare(item)`` for each item of ``source``, up to ``ahead`` of them ahead of the
    consumer, in a daemon thread (on CUDA on a stream of its own, handed over by an event)."""

    def __init__(
        self,
        source: Iterator,
        prepare: Callable[[dict], dict],
        device: torch.device,
        ahead: int = 2,
    ):
        self.source, self.prepare, self.device = source, prepare, torch.device(device)
        self.ready: queue.Queue = queue.Queue(maxsize=max(1, ahead))
        self.stopping = threading.Event()
        cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if cuda else None
        self.thread = threading.Thread(target=self._run, name="mpp-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            if self.stream is not None:
                torch.cuda.set_device(self.device)  # the current device is per thread
            for item in self.source:
                if self.stopping.is_set():
                    return
                self._put(self._prepared(item))
            self._put((_END, None))
        except BaseException as error:  # noqa: BLE001  raised again in the consumer
            self._put((error, None))
        finally:  # a generator left mid-pass is closed here, in its own thread
            getattr(self.source, "close", lambda: None)()

    def _prepared(self, item: dict) -> tuple[dict, torch.cuda.Event | None]:
        if self.stream is None:
            return self.prepare(item), None
        with torch.cuda.stream(self.stream):
            batch = self.prepare(item)
            event = torch.cuda.Event()
            event.record(self.stream)
        return batch, event

    def _put(self, entry: tuple) -> None:
        while not self.stopping.is_set():
            try:
                self.ready.put(entry, timeout=0.1)
                return
            except queue.Full:
                continue

    def __iter__(self) -> Iterator[dict]:
        return self

    def __next__(self) -> dict:
        batch, event = self.ready.get()
        if batch is _END:
            raise StopIteration
        if isinstance(batch, BaseException):
            raise batch
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for value in batch.values():  # its memory is not reused while this stream reads it
                if isinstance(value, torch.Tensor) and value.device.type == "cuda":
                    value.record_stream(current)
        return batch

    def close(self, timeout_s: float = 60.0) -> None:
        """Stop the thread: it ends at its next batch (one the loader is making is waited for)."""
        self.stopping.set()
        while self.thread.is_alive():
            try:  # a thread waiting to hand a batch over takes the freed place and sees the stop
                while True:
                    self.ready.get_nowait()
            except queue.Empty:
                pass
            self.thread.join(timeout=0.1)
            timeout_s -= 0.1
            if timeout_s <= 0:
                break

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
