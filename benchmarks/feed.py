"""feed: what the step waits for between batches (issue 49), on the real loader and prefetcher.

- overlap: a loop of steps whose batches need a decode on the training process's side (a stand-in
  decoder and a stand-in step, each sleeping a known time, so the figure is the overlap alone):
  made ready on the training thread, as before, against ``mpp.data.prefetch.Prefetcher``. The
  loop's time over the longer of the two: 2 when they add up, 1 when they overlap.
- epoch start: the wait for each batch of three epochs with a stand-in step: a pass per epoch
  (``set_epoch`` then a new pass, as before) against one ``onwards`` pass, where the workers go
  into the next epoch themselves, its streams primed during the last batches of this one. The
  first batch of an epoch over the median batch.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from benchmarks.common import format_table

SETTINGS = {
    "full": dict(steps=40, step_s=0.05, decode_s=0.05, images=1800, shards=3, batch=64),
    "quick": dict(steps=6, step_s=0.02, decode_s=0.02, images=256, shards=2, batch=16),
}
CPU = torch.device("cpu")


def _prepare(decode=None):
    from mpp.train.trainer import to_device

    return partial(to_device, device=CPU, mean=(0.5,) * 3, std=(0.5,) * 3, decode=decode)


def overlap(spec: str, steps: int, step_s: float, decode_s: float, prefetch: bool) -> float:
    """Seconds per step of a loop over ``steps`` batches of JPEGs left to the training process
    (``data.decode=gpu``'s path, PIL standing in for nvJPEG, made to take ``decode_s`` a batch),
    each followed by a ``step_s`` stand-in step; from the first batch's arrival on."""
    from mpp.data import device_decode, make_train_loader
    from mpp.data.prefetch import Prefetcher

    loader = make_train_loader(
        spec, batch_size=8, num_batches=steps + 1, img_size=16, defer_jpeg=True, num_workers=1
    )
    decode, last = _prepare(device_decode.on_host), [time.perf_counter()]

    def prepare(batch: dict) -> dict:
        """The batch's wait for the loader, its decode and the rest of making it ready: decode_s."""
        out = decode(batch)
        time.sleep(max(0.0, decode_s - (time.perf_counter() - last[0])))
        last[0] = time.perf_counter()
        return out

    batches = Prefetcher(iter(loader), prepare, CPU) if prefetch else map(prepare, loader)
    try:
        next(batches)
        start = time.perf_counter()
        for batch in batches:
            assert batch["image"].dtype == torch.float32  # normalised, decoded
            time.sleep(step_s)
            if not prefetch:  # inline, the data side's clock starts when the step ends
                last[0] = time.perf_counter()
        return (time.perf_counter() - start) / steps
    finally:
        if prefetch:
            batches.close()
        loader.close()


def epoch_waits(
    spec: str, batch: int, images: int, step_s: float, onwards: bool, img_size: int = 32
) -> list[float]:
    """Seconds from the end of each step to the next batch, three epochs, 2 workers, CPU decode."""
    from mpp.data import make_train_loader
    from mpp.data.prefetch import Prefetcher

    per_epoch = images // batch
    loader = make_train_loader(
        spec,
        batch_size=batch,
        num_batches=per_epoch,
        img_size=img_size,
        num_workers=2,
        persistent=True,
    )
    prepare, waits = _prepare(), []
    try:
        if onwards:
            loader.set_epoch(0, 0, onwards=True)
            passes = [Prefetcher(iter(loader), prepare, CPU)]
        else:
            passes = [map(prepare, _epoch(loader, e)) for e in range(3)]
        for batches in passes:
            t = time.perf_counter()
            for _ in batches:
                waits.append(time.perf_counter() - t)
                time.sleep(step_s)
                t = time.perf_counter()
                if len(waits) == 3 * per_epoch:
                    break
            if onwards:
                batches.close()
    finally:
        loader.close()
    return waits


def _epoch(loader, epoch: int):
    loader.set_epoch(epoch)
    yield from loader


def shards(folder: Path, images: int, count: int, side: int = 64) -> str:
    """``images`` photo-like JPEGs of ``side`` px in ``count`` shards, through ``mpp shards``' writer."""
    from mpp.tools.doctor.engine_run import write_synthetic_shards

    return write_synthetic_shards(folder, side, images, count)


def run(quick: bool = False) -> dict:
    s = SETTINGS["quick" if quick else "full"]
    with tempfile.TemporaryDirectory() as tmp:
        spec = shards(Path(tmp), s["images"], s["shards"])
        longer = max(s["step_s"], s["decode_s"])
        per_step = {
            mode: overlap(spec, s["steps"], s["step_s"], s["decode_s"], mode == "prefetch")
            for mode in ("training thread", "prefetch")
        }
        step = s["step_s"]
        waits = {
            mode: epoch_waits(spec, s["batch"], s["images"], step, mode == "onwards")
            for mode in ("pass per epoch", "onwards")
        }
    per_epoch = s["images"] // s["batch"]
    epoch_rows = {}
    for mode, w in waits.items():
        intervals = [x + step for x in w]
        firsts = [intervals[e * per_epoch] for e in (1, 2)]
        median = statistics.median(intervals)
        epoch_rows[mode] = {
            "first_batch_s": firsts,
            "median_batch_s": median,
            "first_over_median": max(firsts) / median,
        }
    return {
        "setting": s,
        "goal": "loop time / longer of decode and step <= 1.15; an epoch's first batch <= 2 x median",
        "overlap": {m: {"s_per_step": v, "over_longer": v / longer} for m, v in per_step.items()},
        "epoch_start": epoch_rows,
    }


def render(result: dict) -> str:
    s = result["setting"]
    overlap = [{"mode": m, "ms": v["s_per_step"] * 1000, **v} for m, v in result["overlap"].items()]
    epochs = [
        {
            "mode": m,
            "firsts": ", ".join(f"{x * 1000:.0f}" for x in v["first_batch_s"]),
            "median": v["median_batch_s"] * 1000,
            **v,
        }
        for m, v in result["epoch_start"].items()
    ]
    return "\n".join(
        [
            f"decode {s['decode_s'] * 1000:.0f} ms + step {s['step_s'] * 1000:.0f} ms per batch:",
            format_table(
                overlap,
                [
                    ("mode", "batches made ready on", ""),
                    ("ms", "ms per step", ".1f"),
                    ("over_longer", "÷ the longer", ".3f"),
                ],
            ),
            "",
            f"an epoch's first batch, batch {s['batch']}, {s['images']} images in {s['shards']} shards:",
            format_table(
                epochs,
                [
                    ("mode", "loader", ""),
                    ("firsts", "first (ms, epochs 2, 3)", ""),
                    ("median", "median (ms)", ".0f"),
                    ("first_over_median", "÷ median", ".2f"),
                ],
            ),
        ]
    )
