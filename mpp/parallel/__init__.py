"""The only code that knows the process group and DeepSpeed's ZeRO internals: distributed, launch,
zero, ema and ds_config (docs/ARCHITECTURE.md §2.3, §5)."""
