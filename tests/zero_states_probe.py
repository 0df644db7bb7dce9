"""One rank of a real DeepSpeed engine under a fake process group: the bytes of the model states
it holds per ZeRO stage, for tests/test_plan_gpu.py (run as a subprocess: one world size per
process group).

    python tests/zero_states_probe.py WORLD OUT.json [--set key=value ...]

For each stage 0-3: ``deepspeed.initialize`` on rank 0 of ``WORLD`` ranks (collectives are
no-ops), two bf16 steps, and the largest sum of live tensor storages seen at three moments:
inside the backward (after a parameter's gradient lands, when the reduce buckets exist), after
the backward, and when the torch optimiser steps (fp32 gradient partitions and moments).
"""

from __future__ import annotations

import gc
import json
import os
import sys

import torch


def live_bytes() -> int:
    """The bytes of every distinct storage a Python-visible tensor holds."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type == "cpu":
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def measure(stage: int, world: int, overrides: list[str]) -> dict:
    import deepspeed

    from mpp.build import build_objective
    from mpp.config import load_config
    from mpp.train.optim import build_optimizer

    cfg = load_config("mae_demo", [*overrides, f"deepspeed.zero_optimization.stage={stage}"])
    before = live_bytes()  # what earlier stages' engines left behind: subtracted
    objective = build_objective(cfg)
    trainable = [p.numel() for p in objective.parameters() if p.requires_grad]
    frozen = [p.numel() for p in objective.parameters() if not p.requires_grad]
    ds = cfg.deepspeed_config(world, "cpu")
    engine, optimizer, _, _ = deepspeed.initialize(
        model=objective, optimizer=build_optimizer(cfg, objective), config=ds
    )
    peak = {"in_backward": 0, "after_backward": 0, "optimizer_step": 0}

    second = [False]  # the first step creates the moments: its marks are lower than the second's

    def mark(moment: str) -> None:
        if second[0]:
            peak[moment] = max(peak[moment], live_bytes())

    inner = getattr(optimizer, "optimizer", optimizer)
    inner.register_step_pre_hook(lambda *_: mark("optimizer_step"))
    params = [p for p in engine.module.parameters() if p.requires_grad]
    for p in params[:2]:  # the last gradients of the backward: the buckets are full by then
        p.register_post_accumulate_grad_hook(lambda _: mark("in_backward"))
    images = torch.randn(ds["train_micro_batch_size_per_gpu"], 3, 32, 32)
    accum = ds["gradient_accumulation_steps"]
    for i in range(2 * accum):
        second[0] = i >= accum
        loss, _metrics = engine(images)
        engine.backward(loss)
        del loss, _metrics
        mark("after_backward")
        engine.step()
    peak = {moment: held - before for moment, held in peak.items()}
    engine.destroy()
    return {"stage": stage, "trainable": trainable, "frozen": frozen, "ds_config": ds, "peak": peak}


def main() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from mpp.parallel.distributed import skip_shm_comm_op

    world, out = int(sys.argv[1]), sys.argv[2]
    overrides = [a.removeprefix("--set=") for a in sys.argv[3:]]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    skip_shm_comm_op()  # as mpp's runs: DeepSpeed builds no CPU comm op
    rows = [measure(stage, world, overrides) for stage in (0, 1, 2, 3)]
    with open(out, "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main()
