"""Launched by tests/test_scale.py under ``deepspeed --num_gpus 2``: rank 1 is made to see other
files than rank 0 (a sizes.json with more samples, a checkpoint folder whose newest tag it cannot
see yet, as NFS attribute caching can show), then the CLIs' own steps run and each rank prints
what it decided (RANK_DIR/rankN.json). Usage: rank_view.py CONFIG CKPT_ROOT"""

import json
import os
import sys
from pathlib import Path

import mpp.checkpoint.format as ckpt
import mpp.data.census as census_module
import mpp.train.plan as plan_module
from mpp.checkpoint.manager import resolve_on_rank0
from mpp.config import load_config
from mpp.parallel.distributed import from_rank0, init_distributed, world_from_env

config_path, ckpt_root = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
rank, world = world_from_env()
if rank == 1:  # rank 1's view of the shared storage
    real_counts = census_module.known_counts

    def more(shards, run_dir=None):  # 8 shards: 160 more
        return {
            s: census_module.ShardCount(c.samples + 20, c.source)
            for s, c in real_counts(shards, run_dir).items()
        }

    census_module.known_counts = more
    newest = ckpt.latest_complete(ckpt_root)
    ckpt.latest_complete = lambda root: "step00000004" if newest else None
cfg = load_config(config_path)
own = plan_module.plan_run(
    cfg, world, "cpu", 16
).steps_per_epoch  # the rank alone, before the group exists
init_distributed()
plan = from_rank0(
    plan_module.plan_run(cfg, world, "cpu", 16)
)  # as pretrain/run.py and downstream/finetune.py do
found = resolve_on_rank0("auto", ckpt_root)  # as the engine's resume does
decided = {"rank": rank, "own": own, "steps_per_epoch": plan.steps_per_epoch, "tag": found[1]}
Path(ckpt_root).parent.joinpath(f"rank{rank}.json").write_text(
    json.dumps(decided)
)  # not stdout: ranks interleave
os._exit(0)
