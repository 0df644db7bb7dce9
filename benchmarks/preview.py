"""preview: what ``train.preview_every`` costs a run. One preview (8 fixed validation images,
the objective's forward in eval mode, the picture assembled) against one training step
(forward, backward, Adam) of the demo configs' models and batches, interleaved; the overhead at
``preview_every`` = 1000 is preview / (1000 x step). Goal: within one percent of a run without
previews.
On a step between previews the preview is one integer comparison (tests/test_preview.py).
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.common import demo_step, format_table, interleaved_times, median

CONFIGS = ("mpp_demo", "mae_demo", "hpm_demo")
EVERY = 1000


def run(quick: bool = False) -> dict[str, Any]:
    rows = [measure(name, quick) for name in (CONFIGS[:1] if quick else CONFIGS)]
    return {"every": EVERY, "rows": rows, "goal": "overhead_pct <= 1"}


def measure(name: str, quick: bool) -> dict[str, Any]:
    """One config's step and preview, interleaved; medians."""
    from mpp.train.preview import NUM_IMAGES, Preview

    cfg, objective, size, batch, step = demo_step(name, quick)
    preview = Preview(
        1,
        torch.randint(0, 256, (NUM_IMAGES, 3, size, size), dtype=torch.uint8),
        cfg.data.mean,
        cfg.data.std,
        torch.device("cpu"),
        rank=0,
    )

    times = interleaved_times(
        {"step": step, "preview": lambda: preview(objective, 1, [])}, 2 if quick else 5
    )
    step_s, preview_s = median(times["step"]), median(times["preview"])
    return {
        "config": name,
        "batch": batch,
        "step_ms": 1e3 * step_s,
        "preview_ms": 1e3 * preview_s,
        "overhead_pct": 100 * preview_s / (EVERY * step_s),
    }


def render(result: dict[str, Any]) -> str:
    columns = [
        ("config", "config", ""),
        ("batch", "batch", ""),
        ("step_ms", "step ms", ".1f"),
        ("preview_ms", "preview ms", ".1f"),
        ("overhead_pct", f"overhead at every {result['every']} %", ".3f"),
    ]
    return format_table(result["rows"], columns)
