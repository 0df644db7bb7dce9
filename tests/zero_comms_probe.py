"""One rank of a real DeepSpeed engine under a fake process group: the collectives one optimiser
step makes per ZeRO stage, as DeepSpeed's comms_logger records them (op -> bytes of the messages
summed), for tests/test_plan_gpu.py (a subprocess: one world size per process group).

    python tests/zero_comms_probe.py WORLD OUT.json
"""

from __future__ import annotations

import json
import os
import sys

import torch


def measure(stage: int, world: int) -> dict:
    import deepspeed
    from deepspeed.comm import comm

    from mpp.build import build_objective
    from mpp.config import load_config
    from mpp.train.optim import build_optimizer

    overrides = [
        f"deepspeed.zero_optimization.stage={stage}",
        "train.precision=bf16",
        "train.micro_batch_size=4",
    ]
    cfg = load_config("mae_demo", overrides)  # 64 images on 8 ranks: 4 x 2 accumulation steps
    objective = build_objective(cfg)
    ds = cfg.deepspeed_config(world, "cpu")
    ds["comms_logger"] = {"enabled": True, "prof_all": True, "verbose": False}
    engine, *_ = deepspeed.initialize(
        model=objective, optimizer=build_optimizer(cfg, objective), config=ds
    )
    comm.comms_logger.comms_dict.clear()  # initialize's own broadcasts are not a step's
    images = torch.randn(ds["train_micro_batch_size_per_gpu"], 3, 32, 32)
    for _ in range(ds["gradient_accumulation_steps"]):
        loss, _metrics = engine(images)
        engine.backward(loss)
        engine.step()
    logged = {
        op: sum(size * record[0] for size, record in sizes.items())
        for op, sizes in comm.comms_logger.comms_dict.items()
    }
    engine.destroy()
    trainable = sum(p.numel() for p in objective.parameters() if p.requires_grad)
    return {
        "stage": stage,
        "accum": ds["gradient_accumulation_steps"],
        "trainable": trainable,
        "logged": logged,
    }


def main() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mpp.parallel.distributed import skip_shm_comm_op

    world, out = int(sys.argv[1]), sys.argv[2]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    skip_shm_comm_op()  # as mpp's runs: DeepSpeed builds no CPU comm op
    with open(out, "w") as f:
        json.dump([measure(stage, world) for stage in (1, 2, 3)], f)


if __name__ == "__main__":
    main()
