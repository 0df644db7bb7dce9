"""Pretrain a ViT with a masked-patch objective under DeepSpeed (``mpp pretrain``).

deepspeed pretrain/run.py --config mpp_b16.json [--set key=value ...] [--output-dir DIR] [--resume auto|PATH]
python pretrain/run.py --config mpp_demo.json          # one process
python pretrain/run.py --config mpp_b16.json --plan --gpus 64   # the GPU plan (mpp plan): nothing runs
python pretrain/run.py --config mpp_b16.json --submit slurm --nodes 8 --gpus-per-node 8 --partition P --time 72:00:00

The command lives in the package (mpp.commands.pretrain), so an installed wheel has it too:
``mpp pretrain ...``, ``deepspeed --module mpp.commands.pretrain ...``.
"""

import sys

from mpp.commands.pretrain import main

if __name__ == "__main__":
    sys.exit(main())
