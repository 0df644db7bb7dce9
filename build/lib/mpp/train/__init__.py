"""The training runtime: the run resolved before it starts (plan), the engine and its step loop,
optimizer and schedule, metrics, checkpoints (checkpoint, storage, elastic), the guards
(nonfinite, preemption, runlock, rng) and previews while it trains (preview, panels)."""
