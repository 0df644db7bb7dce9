"""One rank of two real DeepSpeed engines at ZeRO stage 0 with fp32 weights: one as the trainer
starts it (``mpp.train.trainer.start_engine``: the multi-tensor all-reduce and clipping of
``mpp.parallel.stage0``), one as ``deepspeed.initialize`` alone makes it (DeepSpeed's per-tensor
path). Same init, same rank-specific images and masks, two optimiser steps of two micro-batches
each, clipping active; rank 0 writes the largest difference between their gradients (reduced,
then clipped) and weights, and between ranks, for tests/test_engine.py.

    deepspeed --num_gpus 3 tests/stage0_probe.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist


def capture(engine) -> dict[str, list[torch.Tensor]]:
    """The gradients of the first optimiser step as the engine reduced them (when it starts to
    clip) and as the optimiser takes them (clipped)."""
    seen: dict[str, list[torch.Tensor]] = {}
    params = [p for p in engine.module.parameters() if p.requires_grad]

    def keep(name, fn):
        def run(*args, **kwargs):
            seen.setdefault(name, [p.grad.clone() for p in params])
            return fn(*args, **kwargs)

        return run

    engine.clip_fp32_gradients = keep("reduced", engine.clip_fp32_gradients)
    engine.optimizer.step = keep("clipped", engine.optimizer.step)
    return seen


def train(cfg, ds: dict, multi_tensor: bool) -> tuple[list[torch.Tensor], dict, bool]:
    import deepspeed

    from mpp.build import build_objective
    from mpp.parallel import stage0
    from mpp.train.optim import build_optimizer
    from mpp.train.trainer import start_engine

    torch.manual_seed(0)
    objective = build_objective(cfg)
    if multi_tensor:
        engine, _ = start_engine(cfg, objective, ds)
        used = engine.allreduce_gradients.__func__ is stage0.allreduce_gradients
    else:
        engine, *_ = deepspeed.initialize(
            model=objective, optimizer=build_optimizer(cfg, objective), config=ds
        )
        used = False
    grads = capture(engine)
    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own images
    torch.manual_seed(1 + rank)  # and its own masks
    for _ in range(2 * ds["gradient_accumulation_steps"]):
        images = torch.randn(ds["train_micro_batch_size_per_gpu"], 3, 32, 32, generator=gen)
        loss, _metrics = engine(images)
        engine.backward(loss)
        engine.step()
    weights = [p.detach().clone() for p in engine.module.parameters() if p.requires_grad]
    engine.destroy()
    return weights, grads, used


def main() -> None:
    from mpp.config import load_config
    from mpp.parallel.distributed import init_distributed

    init_distributed()
    world = dist.get_world_size()
    overrides = [
        "deepspeed.zero_optimization.stage=0",
        "train.precision=bf16-autocast",
        f"train.batch_size={4 * world}",
        "train.micro_batch_size=2",
        "optim.grad_clip=0.05",  # below the gradients' norm: the clip is active
    ]
    cfg = load_config("mae_demo", overrides)
    ds = cfg.deepspeed_config(world, "cpu")
    ours, our_grads, used = train(cfg, ds, multi_tensor=True)
    theirs, their_grads, _ = train(cfg, ds, multi_tensor=False)

    def largest(xs, ys) -> float:
        return max((a - b).abs().max().item() for a, b in zip(xs, ys, strict=True))

    vs_deepspeed = {
        "weights": largest(ours, theirs),
        **{k: largest(our_grads[k], their_grads[k]) for k in ("reduced", "clipped")},
    }
    norms = {k: torch.cat([g.flatten() for g in our_grads[k]]).norm().item() for k in our_grads}
    flat = torch.cat([w.flatten() for w in ours])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    across_ranks = max((g - flat).abs().max().item() for g in gathered)
    moved = largest(ours, train_init(cfg))
    if dist.get_rank() == 0:
        out = {
            "world": world,
            "multi_tensor_path": used,
            "vs_deepspeed": vs_deepspeed,
            "across_ranks": across_ranks,
            "moved": moved,
            "grad_norms": norms,
            "torch_autocast": ds.get("torch_autocast"),
            "gradient_clipping": ds["gradient_clipping"],
        }
        with open(sys.argv[-1], "w") as f:
            json.dump(out, f)


def train_init(cfg) -> list[torch.Tensor]:
    from mpp.build import build_objective

    torch.manual_seed(0)
    return [p.detach().clone() for p in build_objective(cfg).parameters() if p.requires_grad]


if __name__ == "__main__":
    main()
