"""How many of the library's modules one MAE optimiser step calls into, in the training process
(issue 51: at most 12; 20 before). Counted with ``sys.setprofile`` over a step with nothing
periodic due (no log, checkpoint, monitor or preview): from the end of step 3's ``on_step_end``
to the end of step 4's."""

from __future__ import annotations

import sys

import mpp
from mpp.train import trainer as trainer_module

# what the step is: the batch, the trainer, the objective and its model, the lr, the metrics,
# the stop signal's agreement
EXPECTED = {
    "mpp.data.prefetch",
    "mpp.masking",
    "mpp.models.attention",
    "mpp.models.decoder",
    "mpp.models.vit",
    "mpp.objectives.base",
    "mpp.objectives.mae",
    "mpp.ops",
    "mpp.train.metrics",
    "mpp.train.optim",
    "mpp.train.preemption",
    "mpp.train.trainer",
}


def test_one_mae_step_calls_into_at_most_twelve_modules(tmp_path, monkeypatch):
    seen: dict[str, set[str]] = {}

    def profile(frame, event, arg):
        if event == "call" and (name := frame.f_globals.get("__name__", "")).startswith("mpp"):
            seen.setdefault(name, set()).add(frame.f_code.co_name)

    on_step_end = trainer_module.Trainer.on_step_end

    def counted(self, *args):
        on_step_end(self, *args)
        if self.state.step in (3, 4):
            sys.setprofile(profile if self.state.step == 3 else None)

    monkeypatch.setattr(trainer_module.Trainer, "on_step_end", counted)
    train = {"max_steps": 6, "log_every": 5, "ckpt_every": 100, "monitor_every": 100}
    mpp.pretrain("mae_demo", tmp_path / "run", train=train)
    assert seen, "no step was profiled"
    assert len(seen) <= 12 and set(seen) == EXPECTED, {k: sorted(v) for k, v in seen.items()}
