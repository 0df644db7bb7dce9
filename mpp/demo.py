"""The main job on the built-in dataset, end to end, through the real launcher:

    python -m mpp.demo [--ranks N] [--out runs/demo]

pretrain (configs/mpp_demo.json) -> fine-tune it and the same model from scratch
(configs/finetune_demo.json) -> linear probe and k-NN of both (configs/linear_demo.json)
-> a table of top-1. A stage whose results already exist is skipped, so a rerun continues.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from mpp.launch import deepspeed_cmd, default_launcher_args, launch


def run_stage(name: str, cmd: list[str], done: Path, log_dir: Path) -> None:
    """Run one stage unless ``done`` exists; its output goes to ``log_dir/name.log``."""
    if done.exists():
        print(f"[{name}] done already ({done})")
        return
    log = log_dir / f"{name.replace(' ', '_')}.log"
    print(f"[{name}] {' '.join(cmd[cmd.index('--config') - 1 :])}", flush=True)
    t0 = time.time()
    rc = launch(cmd, log)
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise SystemExit(f"[{name}] failed (exit {rc}); log: {log}\n{tail}")
    print(f"[{name}] {time.time() - t0:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="processes for the DeepSpeed runs (default: GPUs, or 2 on CPU)")
    p.add_argument("--out", default="runs/demo", help="where the runs go")
    args = p.parse_args(argv)
    launcher_args = ["--num_gpus", str(args.ranks)] if args.ranks else default_launcher_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    pre = out / "pretrain"
    run_stage("pretrain", deepspeed_cmd(launcher_args, "pretrain/run.py", ["--config", "mpp_demo", "--output-dir", str(pre)]),
              pre / "encoder.safetensors", out)
    inits = {"pretrained": str(pre), "scratch": "scratch"}
    # scratch gets no layer-wise decay: there are no pretrained lower layers to protect
    extra = {"pretrained": [], "scratch": ["--set", "optim.layer_decay=1.0"]}
    for kind, init in inits.items():
        ft = out / f"finetune_{kind}"
        run_stage(f"finetune {kind}", deepspeed_cmd(launcher_args, "downstream/finetune.py", [
                      "--config", "finetune_demo", "--set", f"init={init}", *extra[kind], "--output-dir", str(ft)]),
                  ft / "encoder.safetensors", out)
        for tool in ("linear_probe", "knn"):
            d = out / f"{tool}_{kind}"
            run_stage(f"{tool} {kind}", [py, f"downstream/{tool}.py", "--config", "linear_demo", "--set", f"init={init}",
                                         "--output-dir", str(d)], d / "results.json", out)
    table = {kind: {col: json.loads((out / f"{d}_{kind}" / "results.json").read_text())["top1"]
                    for col, d in (("fine-tune", "finetune"), ("linear", "linear_probe"), ("k-NN", "knn"))}
             for kind in inits}
    (out / "summary.json").write_text(json.dumps(table, indent=2) + "\n")
    print(f"\ntop-1 on the digits validation split (300 images); runs in {out}")
    print(f"{'':<22}{'fine-tune':>10}{'linear':>10}{'k-NN':>10}")
    for kind, row in table.items():
        label = "pretrained (mpp)" if kind == "pretrained" else "from scratch"
        print(f"{label:<22}" + "".join(f"{row[c]:>10.1f}" for c in ("fine-tune", "linear", "k-NN")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
