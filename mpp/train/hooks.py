"""The Trainer's seam (``mpp.train.trainer.Trainer(hooks=...)``): previews, the monitor and a stop
signal's checkpoint plug in here, so the loop's module imports none of them."""

from __future__ import annotations

from typing import Any


class Hook:
    """What a job plugs into the loop (``mpp.jobs`` registers them); every rank calls every
    method, in registration order. ``start``: before the first batch, the run resumed;
    ``step_end``: after an optimiser step (before the evaluation and the checkpoint); ``saved``:
    after the step's checkpoint (written or not due); ``close``: once, however the loop ended.
    Raising stops the run. ``every``: the steps (and the last) at which ``step_end`` and
    ``saved`` are called, 0 never; a step where no hook is due calls into none."""

    every = 1

    def start(self, trainer: Any) -> None:
        pass

    def step_end(self, trainer: Any) -> None:
        pass

    def saved(self, trainer: Any, saved: bool) -> None:
        pass

    def close(self) -> None:
        pass
