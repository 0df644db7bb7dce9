"""The two frozen-encoder tools, downstream/linear_probe.py and downstream/knn.py, once parsed
(``mpp.commands.job.probe_main``): load the encoder from ``init``, extract features on every
rank (``deepspeed --num_gpus N`` / torchrun; one process otherwise) and the GPU when there is
one, evaluate, write results.json (and, with ``--layers all``, results.md and per_block.png)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

import torch

from mpp.checkpoint.manager import encoder_kwargs
from mpp.config import ConfigError
from mpp.data import StreamConfig, make_eval_loader, make_train_loader
from mpp.data.labels import KEY_FILE, LabelledSubset
from mpp.data.stats import Pixels
from mpp.features import FeatureSpec, extract_features, feature_slots, knn_classify
from mpp.hub.pretrained import init_record
from mpp.models.vit import VisionTransformer
from mpp.transfer.probe import HeadTrainer, linear_probes, scaled_lr
from mpp.transfer.probe_protocols import (
    MAE_CROP_SCALE,
    dinov2_probe,
    dinov2_slots,
    mae_heads,
    mae_probe,
    micro_batches,
)


@dataclass(frozen=True)
class ProbeSetup:
    """What a probe evaluates (``probe_setup``): the encoder from ``init``, the shards
    ({"train": the training shards there, "val": every validation shard}), the class count and, with few labels, the training
    subset (``mpp.data.labels``; the validation shards stay whole)."""

    encoder: VisionTransformer
    shards: dict[str, list[str]]
    num_classes: int
    subset: LabelledSubset | None = None
    pixels: Pixels | None = None  # the data's statistics, "auto" measured (run_probe)

    def loader_args(self, split: str) -> dict:
        """``make_eval_loader``'s shards (and subset keys) for ``split``."""
        if split == "train" and self.subset is not None:
            return {"shards": self.subset.shards, "shard_keys": self.subset.keys}
        return {"shards": self.shards[split]}


def probe_parser(kind: str):
    """The training CLIs' arguments, plus --layers (and --protocol for the linear probe)."""
    from mpp.cli import run_parser

    p = run_parser(
        f"{kind} evaluation of a frozen encoder",
        "linear_demo, linear_b16",
        resume=False,
        submit=True,
    )
    if kind == "linear":
        p.add_argument(
            "--protocol",
            choices=["fast", "mae", "dinov2"],
            help="probe.protocol: fast (cached features + SGD), mae (BN + LARS, augmented), dinov2 (a grid)",
        )
    p.add_argument(
        "--layers",
        choices=["last", "all"],
        help="probe.layers: the last block's features, or every block's",
    )
    return p


def run_probe(kind: str, cfg) -> str | None:
    """The probe in this process, on every rank (``mpp.commands.job.probe_main``): rank 0 writes
    its results and returns what it prints (the table per block, the done line)."""
    from mpp.build import with_init_facts
    from mpp.cli import open_run_dir
    from mpp.parallel.distributed import init_distributed, world_from_env
    from mpp.train.plan import labelled_subset, measure_pixels
    from mpp.train.runlock import release

    rank, world, start = *world_from_env(), time.perf_counter()
    setup = probe_setup(cfg, kind)
    device = (
        init_distributed()
        if world > 1
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    # channels and statistics the config leaves unset taken from init, "auto" ones measured; few
    # labels: the subset chosen by the ranks together (the label index is a collective)
    train = setup.shards["train"]
    pixels = measure_pixels(with_init_facts(cfg), train)
    setup = replace(setup, pixels=pixels, subset=labelled_subset(cfg, train, setup.num_classes))
    # held by this job: a second one on it stops here
    model = encoder_kwargs(cfg, setup.encoder)
    run_dir = open_run_dir(cfg, rank, pixels=setup.pixels, model=model, restartable=False)
    if setup.subset is not None and rank == 0:
        setup.subset.write(run_dir / KEY_FILE)
    on_device = replace(setup, encoder=setup.encoder.to(device))
    results = _evaluate(kind, cfg, on_device, rank, world)
    if rank != 0:
        return None
    results = {**results, "eval": kind, "init": cfg.init, **init_record(cfg.init), "ranks": world}
    said = []
    if "per_block" in results:
        title = f"{kind} top-1 per block of {cfg.init}"
        said.append(write_per_block(run_dir, results["per_block"], title))
    (run_dir / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    release(run_dir)
    return "\n".join([*said, done_line(kind, results, time.perf_counter() - start, run_dir)])


def done_line(kind: str, results: dict, seconds: float, run_dir: Path) -> str:
    """The line a probe ends with: its top-1 (and top-5), on how many images (those kept: a bad
    label or image skipped, every protocol), its time, and where results.json is."""
    name = {"linear": f"linear probe ({results.get('protocol', 'fast')})", "knn": "k-NN"}[kind]
    top5 = f", top-5 {results['top5']:.1f} %" if "top5" in results else ""
    images = f"{results['num_train']:,} train, " if "num_train" in results else ""
    skipped = f", {results['skipped']:,} skipped" if results.get("skipped") else ""
    minutes, secs = divmod(round(seconds), 60)
    return (
        f"done: {name} top-1 {results['top1']:.1f} %{top5} ({images}{results['num_val']:,} val "
        f"images kept{skipped}) in {minutes}m{secs:02d}s -> {run_dir}: results.json"
    )


def _evaluate(kind: str, cfg, setup: ProbeSetup, rank: int, world: int) -> dict:
    """The results of this kind and protocol (every rank takes part; only rank 0's count)."""
    d, pr = cfg.data, cfg.probe
    encoder, num_classes = setup.encoder, setup.num_classes
    depth = len(encoder.blocks)
    protocol = pr.protocol if kind == "linear" else "knn"
    slots = (
        dinov2_slots(depth) if protocol == "dinov2" else feature_slots(depth, pr.pool, pr.layers)
    )
    px = setup.pixels
    features = FeatureSpec(slots, px.mean, px.std)
    eval_loader = partial(  # this rank's share of a split, keyed: extract_features orders by key
        make_eval_loader,
        batch_size=min(pr.batch_size, 1024),  # a loader batch, not the probe's step (mae: 16384)
        img_size=encoder.patch_embed.img_size[0],
        num_workers=d.num_workers,
        allow_pipe=d.allow_pipe,
        rank=rank,
        world_size=world,
        with_keys=True,
        # a label outside [0, num_classes) is skipped and counted, as fine-tuning's loader does
        num_classes=num_classes,
        pixels=setup.pixels.format,
    )
    skipped = []  # this rank's bad samples per pass: a label out of range, an unreadable image

    def extract(split: str) -> tuple:
        loader = eval_loader(**setup.loader_args(split))
        feats = extract_features(encoder, loader, features, world_size=world)
        skipped.append(loader.skipped)
        return feats

    val = extract("val")
    facts = {"protocol": protocol} if kind == "linear" else {}
    facts |= {"layers": pr.layers, "num_val": len(val[1])}
    if protocol == "mae":
        res = _mae(cfg, setup, val, features, rank, world)
        return facts | res | {"skipped": _summed(skipped[0] + res["skipped"], world)}
    train = extract("train")
    facts |= {"num_train": len(train[1]), "skipped": _summed(sum(skipped), world)}
    if rank != 0:
        return facts
    if protocol == "dinov2":
        return facts | dinov2_probe(
            train, val, num_classes, depth=depth, settings=pr, seed=cfg.seed
        )
    if protocol == "knn":
        (train_x, train_y), (val_x, val_y) = train, val
        per_slot = [
            knn_classify(
                train_x[:, s], train_y, val_x[:, s], val_y, num_classes, pr.k, pr.temperature
            )
            for s in range(len(slots))
        ]
    else:
        per_slot = linear_probes(*train, *val, num_classes, settings=pr, seed=cfg.seed)
    return facts | _headline(per_slot, slots)


def _summed(count: int, world: int) -> int:
    """Every rank's ``count`` added up (a collective when ``world`` > 1)."""
    if world == 1:
        return count
    import torch.distributed as dist

    counts = [0] * world
    dist.all_gather_object(counts, count)
    return sum(counts)


def _headline(per_slot: list[dict], slots: list) -> dict:
    """The last block's results at the top level; with several blocks, ``per_block`` too."""
    out = dict(per_slot[-1])
    if len(slots) > 1:
        out["per_block"] = [{"block": b, **r} for (b, _), r in zip(slots, per_slot, strict=True)]
    return out


def write_per_block(run_dir: Path, rows: list[dict], title: str) -> str:
    """Top-1 per block (``--layers all``, ``rows``: [{"block", "top1", "top5"}, ...]): a Markdown
    table in results.md, returned to print, and a bar chart in per_block.png (drawn with
    matplotlib where the ``plot`` extra is installed)."""
    lines = [f"# {title}", "", "| block | top-1 (%) | top-5 (%) |", "|---|---|---|"]
    lines += [f"| {r['block']} | {r['top1']:.2f} | {r['top5']:.2f} |" for r in rows]
    table = "\n".join(lines) + "\n"
    (run_dir / "results.md").write_text(table)
    try:
        _plot_per_block(rows, title, run_dir / "per_block.png")
    except ImportError:  # the table is the result; the chart needs the plot extra
        table += "(per_block.png: pip install 'mpp[plot]' to draw it)\n"
    return table


def _plot_per_block(rows: list[dict], title: str, path: Path) -> None:
    """One bar per block, its top-1 written above it. Needs matplotlib (the ``plot`` extra)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(max(3.6, 0.9 + 0.45 * len(rows)), 3.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    bars = ax.bar([str(r["block"]) for r in rows], [r["top1"] for r in rows], color="#1f77b4")
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.set_xlabel("block (0 = first)")
    ax.set_ylabel("top-1 (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def _mae(cfg, setup: ProbeSetup, val: tuple, features: FeatureSpec, rank: int, world: int) -> dict:
    """MAE's protocol: the training stream augmented on the fly (mpp.data's RandomResizedCrop +
    flip at MAE_CROP_SCALE), a step of probe.batch_size images across the ranks, LARS."""
    from mpp.data.census import census

    d, pr = cfg.data, cfg.probe
    encoder, num_classes, slots = setup.encoder, setup.num_classes, features.slots
    # few labels: the stream reads the subset's samples only
    epoch = setup.subset or census(setup.shards["train"], d.allow_pipe)
    total = epoch.total
    steps = total // pr.batch_size  # MAE's loader drops the last partial batch
    if steps < 1 or pr.batch_size % world:
        raise ConfigError(
            f"{cfg._source}: probe.batch_size: {pr.batch_size} must be at most the {total} "
            f"training samples and a multiple of the {world} ranks (the mae protocol's step)"
        )
    lr = scaled_lr(pr.blr, pr.batch_size)
    heads = mae_heads(slots, encoder.embed_dim, num_classes, lr, cfg.seed)
    trainer = HeadTrainer(
        heads,
        total_steps=pr.epochs * steps,
        warmup_steps=pr.warmup_epochs * steps,
        momentum=pr.momentum,
        weight_decay=pr.weight_decay,
        optimizer="lars",
        device=next(encoder.parameters()).device,
    )
    accum = micro_batches(pr.batch_size // world)
    stream = StreamConfig.from_data(
        d,
        epoch,
        batch_size=pr.batch_size // world // accum,
        num_batches=steps * accum,
        global_batch=pr.batch_size,
        img_size=encoder.patch_embed.img_size[0],
        rank=rank,
        world_size=world,
        with_labels=True,
        num_classes=num_classes,
        seed=cfg.seed,
        crop_scale=MAE_CROP_SCALE,
        pixels=setup.pixels.format,
    )
    loader = make_train_loader(epoch.shards, stream, num_workers=d.num_workers, persistent=True)
    try:
        res = mae_probe(
            encoder,
            loader,
            trainer,
            val,
            epochs=pr.epochs,
            accum=accum,
            features=features,
        )
    finally:
        loader.close()
    per_slot = [
        {**r, "max_top1": m, "train_loss": loss}
        for r, m, loss in zip(res["last"], res["max_top1"], res["train_loss"], strict=True)
    ]
    # the samples kept, as the other protocols count them: the census less the ranks' bad ones
    # in the last pass of the stream (every epoch reads the same ones)
    facts = {
        "num_train": total - _summed(loader.skipped, world),
        "lr": lr,
        "steps_per_epoch": steps,
    }
    return facts | _headline(per_slot, slots) | {"skipped": loader.skipped}


def probe_setup(cfg, kind: str, submit: bool = False) -> ProbeSetup:
    """The encoder from ``init``, the train/val shards, the class count; ConfigError names the key.
    ``submit`` (checked here, run there): the shards are the ones the keys name, not looked for
    (they may be visible on the compute nodes only; the job's run checks them)."""
    from mpp.build import build_encoder
    from mpp.data import read_sizes
    from mpp.train.plan import shards

    if kind == "linear" and cfg.probe.protocol == "dinov2" and cfg.probe.layers == "all":
        raise ConfigError(
            f"{cfg._source}: probe.layers: 'all' with probe.protocol 'dinov2', which chooses its own "
            "blocks (the last 1 and 4): use the fast or mae protocol for a per-block table"
        )
    torch.manual_seed(cfg.seed)
    encoder = build_encoder(cfg)
    img = encoder.patch_embed.img_size[0]
    # as pretraining and fine-tuning read them: missing training shards left out (with a
    # warning), none left or any validation shard missing refused
    spec = {role: shards(cfg, role, img, look=not submit, warn=True) for role in ("train", "val")}
    names = (read_sizes(spec["train"]) or {}).get("class_names") or []
    num_classes = cfg.data.num_classes or len(names)
    if not num_classes:
        raise ConfigError(
            f"{cfg._source}: data.num_classes: not set and the shards carry no class list"
        )
    return ProbeSetup(encoder, spec, num_classes)
