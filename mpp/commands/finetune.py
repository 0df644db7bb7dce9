"""Fine-tune a pretrained encoder for classification under DeepSpeed.

mpp finetune --config finetune_demo --set init=runs/mpp_demo      # one process
deepspeed --num_gpus 8 --module mpp.commands.finetune --config finetune_b16 --set init=RUN_DIR|CKPT_DIR|FILE.safetensors|scratch
mpp finetune --config finetune_b16 --set init=RUN_DIR --submit slurm --gpus-per-node 8 --time 24:00:00
(from a clone: deepspeed downstream/finetune.py --config finetune_b16 ...)

The same command run again goes on from the run directory's newest complete checkpoint;
--restart starts over (the earlier run is moved aside, not deleted).
"""

from __future__ import annotations

import sys

from mpp.cli import run_parser
from mpp.commands.job import own_part, train_main
from mpp.config import FinetuneConfig
from mpp.jobs import run_finetune
from mpp.tools.plot import curves_at_end


def main(argv: list[str] | None = None) -> int:
    args = run_parser(__doc__, "finetune_b16, finetune_demo", submit=True).parse_args(argv)
    return train_main(args, argv, "mpp.commands.finetune", FinetuneConfig, run_finetune, _report)


def _report(done) -> None:
    """The line a fine-tuning run ends with: this command's part (``own_part``), the last
    evaluation's top-1 and top-5 (results.json keeps every figure), and where it all is."""
    res, run_dir = done.result, done.run_dir
    print(
        f"done: {own_part(done)}; top-1 {res['top1']:.1f} %, top-5 {res['top5']:.1f} % at epoch "
        f"{res['epoch']:g} (the last evaluation; best {res['max_top1']:.1f} %) -> {run_dir}: "
        f"results.json, model_last.safetensors, metrics.jsonl, {curves_at_end(run_dir)}"
    )


if __name__ == "__main__":
    sys.exit(main())
