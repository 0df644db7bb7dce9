"""Fine-tune a pretrained encoder for classification under DeepSpeed.

mpp finetune --config finetune_demo --set init=runs/mpp_demo      # one process
deepspeed --num_gpus 8 --module mpp.commands.finetune --config finetune_b16 --set init=RUN_DIR|CKPT_DIR|FILE.safetensors|scratch
mpp finetune --config finetune_b16 --set init=RUN_DIR --submit slurm --gpus-per-node 8 --time 24:00:00
(from a clone: deepspeed downstream/finetune.py --config finetune_b16 ...)

The same command run again goes on from the run directory's newest complete checkpoint;
--restart starts over (the earlier run is moved aside, not deleted).
"""

from __future__ import annotations

import json
import sys

from mpp.cli import run_parser
from mpp.commands.job import train_main
from mpp.config import FinetuneConfig
from mpp.jobs import run_finetune
from mpp.tools.plot import curves_at_end


def main(argv: list[str] | None = None) -> int:
    args = run_parser(__doc__, "finetune_b16, finetune_demo", submit=True).parse_args(argv)
    return train_main(args, argv, "mpp.commands.finetune", FinetuneConfig, run_finetune, _report)


def _report(done) -> None:
    print(f"curves: {curves_at_end(done.run_dir)}", file=sys.stderr)
    print(json.dumps({k: done.result[k] for k in ("top1", "top5", "epoch", "init")}))


if __name__ == "__main__":
    sys.exit(main())
