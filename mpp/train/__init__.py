"""The training runtime: the run resolved before it starts (plan), the engine and its step loop,
optimizer and schedule, metrics, the guards (nonfinite, preemption, runlock, rng), the monitor and
previews while it trains (monitor, preview, panels). Its checkpoints are mpp.checkpoint's."""
