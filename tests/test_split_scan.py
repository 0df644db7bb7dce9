"""The one rank-split scan (``mpp.parallel.distributed.split_scan``): two gloo ranks give what one
gives, for the helper and for each scan built on it (the census, the label index, the pixel
statistics, a checkpoint's manifest)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch.distributed as dist
import torch.multiprocessing as mp

from mpp.checkpoint.storage import manifest
from mpp.data import WriterOptions, write_shards
from mpp.data.census import census
from mpp.data.labels import label_index
from mpp.data.stats import measure
from mpp.data.transforms import PixelFormat
from mpp.parallel.distributed import split_scan
from mpp.parallel.launch import free_port


def scans(folder: Path) -> dict:
    shards = sorted(str(p) for p in folder.glob("*.tar"))
    stats = measure(shards, PixelFormat(3), samples=100)  # every image
    return {
        "squares": split_scan(list(range(5)), lambda x: x * x),
        "counts": census(shards).sizes,
        "labels": label_index(shards).samples,
        "stats": (np.round(stats.mean + stats.std, 12).tolist(), stats.value_range, stats.images),
        "manifest": manifest(folder),
    }


def rank(r: int, world: int, port: int, folder: Path, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=r, world_size=world)
    try:
        out[r] = scans(folder)
    finally:
        dist.destroy_process_group()


def test_two_ranks_scan_what_one_scans(tmp_path):
    rng = np.random.default_rng(0)
    images = [(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8), i % 3) for i in range(11)]
    options = WriterOptions(max_count=3, progress=False)
    write_shards(images, tmp_path / "shards", "s", options=options)
    one = scans(tmp_path / "shards")  # no process group
    for cache in (tmp_path / "shards").glob(".mpp_*"):  # the ranks scan again, not read these
        cache.unlink()
    # spawned, not forked: a forked rank would inherit this worker's process group (the session's
    # one-rank group of another test) and could not make its own
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(
            rank, (2, free_port(), tmp_path / "shards", out), nprocs=2, start_method="spawn"
        )
        two = dict(out)
    assert one["squares"] == [0, 1, 4, 9, 16] and one["counts"] == [3, 3, 3, 2]
    assert one["stats"][2] == 11 and sum(map(len, one["labels"])) == 11
    assert two[0] == two[1] == one
