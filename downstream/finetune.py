"""Fine-tune a pretrained encoder for classification under DeepSpeed (``mpp finetune``).

deepspeed downstream/finetune.py --config finetune_b16.json --set init=RUN_DIR|CKPT_DIR|FILE.safetensors|scratch
python downstream/finetune.py --config finetune_demo.json --set init=runs/mpp_demo
python downstream/finetune.py --config finetune_b16.json --set init=RUN_DIR --submit slurm --gpus-per-node 8 --time 24:00:00

The command lives in the package (mpp.commands.finetune): ``mpp finetune ...``,
``deepspeed --module mpp.commands.finetune ...``.
"""

import sys

from mpp.commands.finetune import main

if __name__ == "__main__":
    sys.exit(main())
