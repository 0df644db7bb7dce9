import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpp.parallel.launch import free_port, job_env  # noqa: F401  (free_port: for the tests)

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# the venv's ninja first, also for DeepSpeed in this process: a second ninja version on PATH
# invalidates DeepSpeed's JIT-built comm op in the shared cache (a 30-100 s rebuild each time)
os.environ["PATH"] = f"{BIN}:{os.environ['PATH']}"
# in-process tests use tiny models: one thread each. With two threads on a shared 2-core
# machine a small training loop was measured 10-60x slower (thread oversubscription)
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def digits16(tmp_path_factory):
    """The built-in digits dataset as 16-px shards, built once per test session."""
    from mpp.data import digits_shards

    return digits_shards(img_size=16, cache_dir=str(tmp_path_factory.mktemp("digits")))


def tiny_config(digits, **sections) -> dict:
    """A 2-block ViT on 16-px digits: seconds per run on a 2-core CPU."""
    cfg = {
        "name": "t",
        "model": {"name": "vit_tiny_patch4_16", "depth": 2, "embed_dim": 32, "num_heads": 2},
        "objective": {"name": "mpp"},
        "masking": {"strategy": "random"},
        "data": {"train_shards": digits["train"], "num_workers": 1, "shuffle_buffer": 64},
        "optim": {"lr": 1e-3, "warmup_steps": 2},
        "train": {
            "batch_size": 16,
            "max_steps": 4,
            "log_every": 1,
            "ckpt_every": 2,
            "seed": 0,
            "precision": "fp32",
        },  # fp32 on a GPU too: the assertions are fp32 facts
        "deepspeed": {"zero_optimization": {"stage": 0}},
    }
    for key, value in sections.items():
        cfg[key].update(value)
    return cfg


def zero(stage: int) -> dict:
    """DeepSpeed's zero_optimization for a test: at stage 3 every parameter partitioned (the
    default keeps those under 1e5 elements whole, which is every parameter of a tiny model)."""
    return {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(json.dumps(cfg))
    return path


def cli_env(extra: dict | None = None) -> dict:
    """The environment for a CLI or launcher (the venv first on PATH, no distributed variables)."""
    return {**job_env(), **(extra or {})}


def run_cli(
    args: list[str], timeout: int = 240, env: dict | None = None, **kw
) -> subprocess.CompletedProcess:
    """Run a command from the repo root; output captured as text."""
    return subprocess.run(
        args, cwd=REPO, env=cli_env(env), capture_output=True, text=True, timeout=timeout, **kw
    )


def restamp(tag_dir: Path) -> None:
    """Rewrite a checkpoint's COMPLETE marker to match its files, as whoever tampers with a file can:
    the manifest finds damage, it is no defence against a crafted file (weights_only loading is)."""
    from mpp.train.storage import manifest

    marker = Path(tag_dir) / "COMPLETE"
    record = json.loads(marker.read_text())
    record["files"] = {n: r for n, r in manifest(Path(tag_dir)).items() if n != "COMPLETE"}
    marker.write_text(json.dumps(record) + "\n")


def read_metrics(run_dir: Path, kind: str = "all") -> list[dict]:
    from mpp.train.metrics import read_records

    return read_records(run_dir, kind)


@pytest.fixture(scope="session")
def dist_group():
    """A one-process gloo group, as ``python pretrain/run.py`` makes, for in-process DeepSpeed."""
    from mpp.parallel.distributed import init_distributed

    init_distributed()
    yield


@pytest.fixture(scope="session")
def two_rank_runs(tmp_path_factory, digits16):
    """ZeRO-2 and ZeRO-3 runs of the same config on 2 ranks: computed once, checked by several tests."""
    tmp = tmp_path_factory.mktemp("zero")
    runs: dict = {"ports": []}
    for stage in (2, 3):
        # a preview at step 2: under ZeRO-3 its forward gathers the partitioned parameters on both ranks
        cfg = tiny_config(
            digits16,
            train={"max_steps": 3, "ckpt_every": 2, "preview_every": 2},
            deepspeed={"zero_optimization": zero(stage)},
        )
        path = write_config(tmp / f"z{stage}.json", cfg)
        out = tmp / f"z{stage}"
        runs["ports"].append(port := free_port())
        r = run_cli(
            [
                "deepspeed",
                "--num_gpus",
                "2",
                "--master_port",
                str(port),
                "pretrain/run.py",
                "--config",
                str(path),
                "--output-dir",
                str(out),
            ]
        )
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[stage] = (out, path)
    return runs
