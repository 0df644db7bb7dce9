"""data: the input pipeline's cost over a bare PIL decode, its cost on bad data, and the
workers a step rate needs.

The measurements are ``benchmarks.data_timing.bench_pipeline`` (one process, so its images/s is what
one DataLoader worker delivers on one core) and ``bench_bad_data`` (clean shards against the
same shards with 5 % garbage JPEGs); this suite adds the sizing:
workers = ceil(step images/s ÷ pipeline images/s per worker).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from benchmarks.common import format_table
from benchmarks.data_timing import (
    bench_bad_data,
    bench_census,
    bench_epoch_start,
    bench_pipeline,
)
from mpp.tools.planner.report import workers_needed

SETTINGS = {
    "full": dict(num_images=512, img_size=224, repeats=3, num_shards=1024, members=1000),
    "quick": dict(num_images=64, img_size=224, repeats=1, num_shards=8, members=100),
}
COST_RATIO_GOAL = 1.10  # pipeline time per image ÷ bare decode + resize (benchmarks.data_timing)
BAD_DATA_GOAL = 0.90  # images/s delivered from 5 %-garbage shards ÷ from clean ones
# a GPU step rate to size the loader for (the figure for ViT-B/16 bf16 on one H100)
DEFAULT_RATES = {"ViT-B/16 bf16, one H100 (assumed)": 3000.0}
CPU_STEP_JSON = "runs/benchmarks/cpu-step.json"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--step-ips",
        action="append",
        default=[],
        metavar="LABEL=IPS",
        help="a training step rate (images/s) to size the loader for; repeatable",
    )
    p.add_argument(
        "--cpu-step-json",
        default=CPU_STEP_JSON,
        help="a cpu-step result whose measured rates to size for (skipped if missing)",
    )


def step_rates(step_ips: list[str], cpu_step_json: str | None) -> dict[str, float]:
    """Rates to size for: the defaults, the cpu-step suite's measured ones, and ``LABEL=IPS`` items."""
    rates = dict(DEFAULT_RATES)
    if cpu_step_json and Path(cpu_step_json).is_file():
        result = json.loads(Path(cpu_step_json).read_text())
        model = result["setting"]["model"]
        for row in result["rows"]:
            rates[f"{row['objective']} {model} fp32, this CPU (cpu-step)"] = row["imgs_per_sec"]
    for item in step_ips:
        label, _, ips = item.rpartition("=")
        if not label:
            raise ValueError(f"--step-ips {item!r}: expected LABEL=IPS")
        rates[label] = float(ips)
    return rates


def node_buffer_gib(
    mean_bytes: float, ranks: int = 8, streams: int = 64, windows=(16, 64)
) -> dict[int, float]:
    """Encoded images the streams' shuffle windows of one node hold (mpp.data.order): window x image
    size x streams per rank (the *_b16 global batch 4096 on 64 ranks) x ranks."""
    return {w: w * mean_bytes * streams * ranks / 2**30 for w in windows}


def bench_formats(num_images: int, img_size: int, repeats: int, **_: Any) -> dict[str, Any]:
    """Decode + augment (RandomResizedCrop, flip) per worker, one process, on 256-px sources:
    8-bit RGB JPEG (the draft fast path) against 4-band uint16 TIFF (tifffile), 4-band uint16 and
    float32 .npy: images/s each, and each one's time per image as a ratio of the JPEG's."""
    import io
    import random
    import time

    import numpy as np
    import tifffile
    from PIL import Image

    from mpp.data.transforms import PixelFormat, train_transform

    rng = np.random.default_rng(0)
    smooth = lambda c: np.asarray(  # noqa: E731  a photograph-like field, not noise
        Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).resize((256, 256))
    )[:, :, np.arange(c) % 3]

    def encode(kind: str) -> bytes:
        out = io.BytesIO()
        if kind == "RGB JPEG":
            Image.fromarray(smooth(3)).save(out, format="JPEG", quality=90)
        elif kind == "uint16 4-band TIFF":
            tifffile.imwrite(out, (smooth(4).astype(np.uint16) * 257).transpose(2, 0, 1))
        elif kind == "uint16 4-band npy":
            np.save(out, smooth(4).astype(np.uint16) * 257)
        else:
            np.save(out, smooth(4).astype(np.float32) / 255)
        return out.getvalue()

    formats = {
        "RGB JPEG": PixelFormat(3),
        "uint16 4-band TIFF": PixelFormat(4, value_range=(0, 65535)),
        "uint16 4-band npy": PixelFormat(4, value_range=(0, 65535)),
        "float32 4-band npy": PixelFormat(4, value_range=(0, 1)),
    }
    rows = []
    for kind, fmt in formats.items():
        data = [encode(kind) for _ in range(num_images)]
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for i, d in enumerate(data):
                train_transform(d, img_size, random.Random(i), fmt=fmt)
            best = min(best, time.perf_counter() - t0)
        rows.append({"format": kind, "bytes": len(data[0]), "ips": num_images / best})
    jpeg = rows[0]["ips"]
    for row in rows:
        row["time_ratio"] = jpeg / row["ips"]
    return {"num_images": num_images, "img_size": img_size, "source": 256, "rows": rows}


def run(
    quick: bool = False, step_ips: list[str] | None = None, cpu_step_json: str | None = None
) -> dict[str, Any]:
    s = SETTINGS["quick" if quick else "full"]
    bench = bench_pipeline(**s)
    formats = bench_formats(**s)
    bad = bench_bad_data(**s)
    start = bench_epoch_start(**s)
    counted = bench_census(**s)
    per_worker = bench["pipeline_ips"]
    sizing = [
        {"step": label, "step_ips": ips, "workers": workers_needed(ips, per_worker)}
        for label, ips in step_rates(step_ips or [], cpu_step_json).items()
    ]
    return {
        "setting": s,
        "pipeline": bench,
        "bad_data": bad,
        "epoch_start": start,
        "census": counted,
        "formats": formats,
        "node_buffer_gib": node_buffer_gib(start["mean_encoded_bytes"]),
        "per_worker_ips": per_worker,
        "sizing": sizing,
        "goal": {
            "cost_ratio_max": COST_RATIO_GOAL,
            "cost_ratio": bench["cost_ratio"],
            "bad_data_ratio_min": BAD_DATA_GOAL,
            "bad_data_ratio": bad["throughput_ratio"],
            "met": bench["cost_ratio"] <= COST_RATIO_GOAL
            and bad["throughput_ratio"] >= BAD_DATA_GOAL,
        },
    }


def render(result: dict[str, Any]) -> str:
    b = result["pipeline"]
    w, h = b["source_size"]
    rows = [
        {
            "what": f"bare PIL decode (draft) + resize to {b['img_size']}",
            "ips": b["bare_decode_resize_ips"],
        },
        {
            "what": "train pipeline (tar, shuffle, RandomResizedCrop, flip, batch)",
            "ips": b["pipeline_ips"],
        },
        {"what": "train pipeline, crop = whole image", "ips": b["pipeline_full_crop_ips"]},
    ]
    table = format_table(
        rows,
        [("what", f"{b['num_images']} JPEGs {w}x{h}, one process", ""), ("ips", "img/s", ".1f")],
    )
    ratios = (
        f"cost ratio (pipeline ÷ bare, time per image): {b['cost_ratio']:.3f} (goal <= {COST_RATIO_GOAL}); "
        f"overhead ratio (whole-image crop ÷ bare): {b['overhead_ratio']:.3f}"
    )
    d = result["bad_data"]
    bad = (
        f"bad data: {d['bad_fraction']:.0%} garbage JPEGs, {d['skipped_per_pass']} skipped per pass; "
        f"clean {d['clean_ips']:.1f} img/s, bad {d['bad_data_ips']:.1f} img/s delivered: "
        f"ratio {d['throughput_ratio']:.3f} (goal >= {BAD_DATA_GOAL})"
    )
    e = result["epoch_start"]
    start = (
        f"epoch start (first batch, {e['num_workers']} workers): new workers {e['first_batch_s_new_workers']:.3f} s, "
        f"persistent {e['first_batch_s_persistent']:.3f} s (x{e['restart_ratio']:.1f}); shuffle windows per node "
        f"(8 ranks x 64 streams, {e['mean_encoded_bytes'] / 1e3:.0f} kB images): "
        + ", ".join(f"window {k} {v:.2f} GiB" for k, v in result["node_buffer_gib"].items())
    )
    c = result["census"]
    census = (
        f"shard census (mpp.data.census), {c['num_shards']} shards x {c['members_per_shard']} members, no "
        f"sizes.json: first scan {c['first_scan_s']:.2f} s ({'cold' if c['first_scan_cold_cache'] else 'warm'} "
        f"page cache), warm {c['warm_scan_s']:.2f} s ({c['members_per_s_warm']:,.0f} members/s, one process), "
        f"cache hit {c['cache_hit_s'] * 1e3:.1f} ms (x{c['scan_to_hit_ratio']:,.0f})"
    )
    sizing = format_table(
        result["sizing"],
        [
            ("step", "step to feed", ""),
            ("step_ips", "img/s", ".1f"),
            ("workers", "workers needed", "d"),
        ],
    )
    f = result["formats"]
    formats = format_table(
        f["rows"],
        [
            ("format", f"decode + augment to {f['img_size']} px, {f['source']}-px sources", ""),
            ("bytes", "bytes", "d"),
            ("ips", "img/s per worker", ".1f"),
            ("time_ratio", "time per image / JPEG's", ".2f"),
        ],
    )
    return f"{table}\n{ratios}\n{bad}\n{start}\n{census}\n\n{formats}\n\n{sizing}"
