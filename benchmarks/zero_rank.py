"""The zero suite's launcher entry: pretrain/run.py's ``main``, plus this rank's peak RSS.

    deepspeed --num_gpus 2 benchmarks/zero_rank.py --config C --set ...

Writes ``$MPP_BENCH_RSS_DIR/rank{RANK}.json``, in MiB: the RSS high-water mark after the
libraries are imported (baseline); the RSS just before and after ``deepspeed.initialize``
(the model built on every rank, then the engine's ZeRO buffers); the high-water mark and the
RSS at the first checkpoint save (the training peak, and what stays resident after the steps:
the engine saves only at the end when ckpt_every > max_steps); the high-water mark at exit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks.common import current_rss_bytes, peak_rss_bytes


def peak_rss_mib() -> float:
    return peak_rss_bytes() / 2**20


def main() -> int:
    import deepspeed  # in the baseline: every stage loads it

    import mpp.checkpoint.format as ckpt
    from mpp.commands.pretrain import main as run_main

    record = {"baseline_mib": peak_rss_mib()}
    save = ckpt.save_checkpoint

    def save_and_record(*args, **kwargs):
        # the final checkpoint and the fp32 export gather state that training never holds
        record.setdefault("train_peak_mib", peak_rss_mib())
        record.setdefault("after_steps_mib", current_rss_bytes() / 2**20)  # resident, not peak
        return save(*args, **kwargs)

    ckpt.save_checkpoint = save_and_record  # the engine calls ckpt.save_checkpoint
    initialize = deepspeed.initialize

    def initialize_and_record(*args, **kwargs):
        record["before_init_mib"] = current_rss_bytes() / 2**20
        out = initialize(*args, **kwargs)
        record["after_init_mib"] = current_rss_bytes() / 2**20
        return out

    deepspeed.initialize = initialize_and_record  # the engine calls deepspeed.initialize
    code = run_main(sys.argv[1:])
    record["exit_peak_mib"] = peak_rss_mib()
    out = Path(os.environ["MPP_BENCH_RSS_DIR"]) / f"rank{os.environ.get('RANK', '0')}.json"
    out.write_text(json.dumps(record))
    return code


if __name__ == "__main__":
    sys.exit(main())
