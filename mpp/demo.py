"""The main job on the built-in dataset, end to end, through the real launcher:

    python -m mpp.demo [--ranks N] [--out runs/demo]

pretrain (configs/mpp_demo.json) -> fine-tune it and the same model from scratch
(configs/finetune_demo.json) -> linear probe and k-NN of both (configs/linear_demo.json)
-> a table of top-1. A stage whose results already exist is skipped, so a rerun continues.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def default_ranks() -> int:
    """One rank per GPU, else 2 CPU ranks (gloo)."""
    import torch

    return torch.cuda.device_count() or 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher(ranks: int) -> list[str]:
    """``deepspeed --num_gpus N --master_port P`` from this interpreter's environment."""
    exe = Path(sys.executable).parent / "deepspeed"
    return [str(exe), "--num_gpus", str(ranks), "--master_port", str(_free_port())]


def run_stage(name: str, cmd: list[str], done: Path, log_dir: Path) -> None:
    """Run one stage unless ``done`` exists; its output goes to ``log_dir/name.log``."""
    if done.exists():
        print(f"[{name}] done already ({done})")
        return
    log = log_dir / f"{name}.log"
    print(f"[{name}] {' '.join(cmd[cmd.index('--config') - 1 :]) if '--config' in cmd else ' '.join(cmd)}", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.call(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-15:])
        raise SystemExit(f"[{name}] failed (exit {rc}); log: {log}\n{tail}")
    print(f"[{name}] {time.time() - t0:.0f} s", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=None, help="processes for the DeepSpeed runs (default: GPUs, or 2 on CPU)")
    p.add_argument("--out", default="runs/demo", help="where the runs go")
    args = p.parse_args(argv)
    ranks = args.ranks or default_ranks()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    pre = out / "pretrain"
    run_stage("pretrain", [*launcher(ranks), "pretrain/run.py", "--config", "mpp_demo", "--output-dir", str(pre)],
              pre / "encoder.safetensors", out)
    inits = {"pretrained": str(pre), "scratch": "scratch"}
    # scratch gets no layer-wise decay: there are no pretrained lower layers to protect
    extra = {"pretrained": [], "scratch": ["--set", "optim.layer_decay=1.0"]}
    for kind, init in inits.items():
        ft = out / f"finetune_{kind}"
        run_stage(f"finetune {kind}", [*launcher(ranks), "downstream/finetune.py", "--config", "finetune_demo",
                                       "--set", f"init={init}", *extra[kind], "--output-dir", str(ft)],
                  ft / "encoder.safetensors", out)
        for tool in ("linear_probe", "knn"):
            d = out / f"{tool}_{kind}"
            run_stage(f"{tool} {kind}", [py, f"downstream/{tool}.py", "--config", "linear_demo", "--set", f"init={init}",
                                         "--output-dir", str(d)], d / "results.json", out)
    table = {kind: {col: json.loads((out / f"{d}_{kind}" / "results.json").read_text())["top1"]
                    for col, d in (("fine-tune", "finetune"), ("linear", "linear_probe"), ("k-NN", "knn"))}
             for kind in inits}
    (out / "summary.json").write_text(json.dumps(table, indent=2) + "\n")
    print(f"\ntop-1 on the digits validation split (300 images), {ranks} rank(s); runs in {out}")
    print(f"{'':<22}{'fine-tune':>10}{'linear':>10}{'k-NN':>10}")
    for kind, row in table.items():
        label = "pretrained (mpp)" if kind == "pretrained" else "from scratch"
        print(f"{label:<22}" + "".join(f"{row[c]:>10.1f}" for c in ("fine-tune", "linear", "k-NN")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
