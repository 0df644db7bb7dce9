"""The only code that knows the process group and DeepSpeed's ZeRO internals: the process group
(distributed), the launcher (launch), ZeRO-3 partitioned parameters (zero), an EMA over them
(ema) and the DeepSpeed config derived from ours (ds_config)."""
