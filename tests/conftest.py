import base64
import io
import json
import os
import pickle
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import forkrun
import pytest
import torch
from filelock import FileLock

from mpp.parallel.launch import free_port, job_env

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# the venv's ninja first, also for DeepSpeed in this process: a second ninja version on PATH
# invalidates whatever DeepSpeed JIT-built in the shared cache (a 30-100 s rebuild each time)
os.environ["PATH"] = f"{BIN}:{os.environ['PATH']}"
# in-process tests use tiny models: one thread each. With two threads on a shared 2-core
# machine a small training loop was measured 10-60x slower (thread oversubscription)
torch.set_num_threads(1)
# ... and every process the tests start (CLIs, the launchers' ranks) one intra-op thread too: 2
# ranks and their data workers on 2 shared cores ran a 16-step run 2-3x slower with torch's
# default of a thread per core (measured 67 s -> 30 s, one process 41 s -> 18 s); a value set
# outside is kept
os.environ.setdefault("OMP_NUM_THREADS", "1")
# unbuffered as python -u and the launchers' ranks: forkrun's server is started with this
# environment, and a buffered line would be written twice by a data worker forked from a rank
os.environ.setdefault("PYTHONUNBUFFERED", "1")


# make test runs --dist loadfile --no-loadscope-reorder: the files go out to the 2 workers in the
# order collected, and these go first, the longest first (a full suite's durations with forkrun,
# 2026-11-27), so that no long one starts while the other worker is nearly done; xdist's default
# sends the files with the most tests first, most of them quick. (Grouping files that share a session
# fixture's runs with --dist loadgroup does not work with pytest 9: xdist 3.8 renames the test
# ids through Node._nodeid, which pytest 9 no longer reads, so every test became its own group.)
LONGEST_FIRST = (
    "test_ablate",
    "test_preemption",
    "test_benchmarks",
    "test_api",
    "test_reference",
    "test_plan_gpu",
    "test_submit",
    "test_demo_runs",
    "test_runner",
    "test_elastic",
    "test_faults",
    "test_doctor",
    "test_channels_runs",
    "test_object_storage",
    "test_hpm_zero",
    "test_engine",
    "test_downstream",
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a file's order kept


@pytest.fixture(scope="session")
def digits16(tmp_path_factory):
    """The built-in digits dataset as 16-px shards, built once per test session."""
    from mpp.data import digits_shards

    return digits_shards(img_size=16, cache_dir=str(tmp_path_factory.mktemp("digits")))


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory) -> dict:
    """The shipped demo configs' data (the built-in digits at 32 px), built once per session:
    ``env`` for a CLI run of a demo config ($MPP_CACHE, not the user's ~/.cache/mpp)."""
    from mpp.data import digits_shards

    cache = tmp_path_factory.mktemp("mpp_cache")
    digits_shards(32, cache_dir=str(cache))
    return {"MPP_CACHE": str(cache)}


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


def write_tar(path, members: list[tuple[str, bytes]]) -> str:
    """A plain tar of (member name, bytes), as tools other than ours write shards."""
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return str(path)


def zero(stage: int) -> dict:
    """DeepSpeed's zero_optimization for a test: at stage 3 every parameter partitioned (the
    default keeps those under 1e5 elements whole, which is every parameter of a tiny model)."""
    return {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})}


def listed_samples(spec) -> int:
    """The samples the shards' sizes.json lists for ``spec`` (a shard spec or list), every shard's."""
    from mpp.data import expand_shards, read_sizes

    shards = expand_shards(spec)
    listed = read_sizes(shards)["shards"]
    return sum(listed[s.rsplit("/", 1)[-1]] for s in shards)


@pytest.fixture(scope="session", autouse=True)
def forkserver():
    """forkrun's server, started before the first test (not inside one that patches the env)."""
    forkrun.start()


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(json.dumps(cfg))
    return path


def cli_env(extra: dict | None = None) -> dict:
    """The environment for a CLI or launcher (the venv first on PATH, no distributed variables)."""
    return {**job_env(), **(extra or {})}


def run_cli(
    args: list[str], timeout: int = 240, env: dict | None = None, fresh: bool = False
) -> subprocess.CompletedProcess:
    """Run a command from the repo root; output captured as text. A python command or a launch
    runs forked from a warm interpreter (forkrun) unless ``fresh``."""
    done = None if fresh else forkrun.run(args, REPO, cli_env(env), timeout)
    return done or subprocess.run(
        args, cwd=REPO, env=cli_env(env), capture_output=True, text=True, timeout=timeout
    )


def restamp(tag_dir: Path) -> None:
    """Rewrite a checkpoint's COMPLETE marker to match its files, as whoever tampers with a file can:
    the manifest finds damage, it is no defence against a crafted file (weights_only loading is)."""
    from mpp.checkpoint.storage import manifest

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


def launcher(ranks: int) -> list[str]:
    """DeepSpeed's launcher for RANKS ranks on this node: what the ``deepspeed --num_gpus RANKS``
    runner runs on one node (``python -m deepspeed.launcher.launch``, the world encoded, the
    environment as it is) without the runner's own start, a second import of DeepSpeed: 2-4 s of
    CPU per launch on this machine. The tests of the runner itself (signals to it, its
    multi-node flags, the wheel, the product's own launches) run ``deepspeed``."""
    world = base64.urlsafe_b64encode(json.dumps({"localhost": list(range(ranks))}).encode())
    module = [sys.executable, "-u", "-m", "deepspeed.launcher.launch"]
    flags = ["--master_addr", "127.0.0.1", "--master_port", str(free_port()), "--log_level=info"]
    return [*module, f"--world_info={world.decode()}", *flags]


def launch_cmd(
    ranks: int, cfg_path, out, *extra: str, script: str = "pretrain/run.py", runner: bool = False
) -> list[str]:
    """``launcher(RANKS) SCRIPT --config CFG --output-dir OUT EXTRA``; with ``runner``, the
    command a user types: ``deepspeed --num_gpus RANKS --master_port <free> SCRIPT ...``."""
    head = (
        ["deepspeed", "--num_gpus", str(ranks), "--master_port", str(free_port())]
        if runner
        else launcher(ranks)
    )
    return [*head, script, "--config", str(cfg_path), "--output-dir", str(out), *extra]


@pytest.fixture(scope="session")
def once(tmp_path_factory, request):
    """``once(name, build)``: ``build(folder)``'s result, built once for the whole session. Under
    xdist a session fixture runs once per worker: here the first worker to ask builds it under a
    file lock and the other reads the result (pickled), so the suite's shared runs are launched
    once, not once per worker."""
    made: dict = {}
    if not hasattr(request.config, "workerinput"):  # no xdist worker: the session is the suite

        def local(name: str, build):
            if name not in made:
                made[name] = build(tmp_path_factory.mktemp(name))
            return made[name]

        return local
    root = tmp_path_factory.getbasetemp().parent / "once"  # the workers' common folder
    root.mkdir(exist_ok=True)

    def get(name: str, build):
        with FileLock(root / f"{name}.lock"):
            done = root / f"{name}.pickle"
            if not done.exists():  # a folder of its own per try: a failed one may still be written
                result = build(Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root)))
                (root / f"{name}.part").write_bytes(pickle.dumps(result))
                os.replace(root / f"{name}.part", done)
            return pickle.loads(done.read_bytes())

    return get


@pytest.fixture(scope="session")
def two_rank_runs(once, digits16):
    """ZeRO-2 and ZeRO-3 runs of the same config on 2 ranks: computed once, checked by several tests."""
    return once("zero", lambda tmp: _two_rank_runs(tmp, digits16))


def _two_rank_runs(tmp: Path, digits16) -> dict:
    runs: dict = {"ports": [], "extensions": tmp / "torch_extensions"}  # DeepSpeed's JIT builds
    for stage in (2, 3):
        # a preview at step 2: under ZeRO-3 its forward gathers the partitioned parameters on both ranks
        cfg = tiny_config(
            digits16,
            train={"max_steps": 3, "ckpt_every": 2, "preview_every": 2},
            deepspeed={"zero_optimization": zero(stage)},
        )
        path = write_config(tmp / f"z{stage}.json", cfg)
        out = tmp / f"z{stage}"
        cmd = launch_cmd(2, path, out)
        runs["ports"].append(int(cmd[cmd.index("--master_port") + 1]))
        r = run_cli(cmd, env={"TORCH_EXTENSIONS_DIR": str(runs["extensions"])})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        runs[stage] = (out, path)
    return runs


# The straight 16-step 2-rank runs (straight_runs): a global batch of 12 in micro batches of 2
# (accumulation 3 on 2 ranks, 2 on 3 ranks, 6 on 1: the elastic resumes), 16 of the epoch's 124
# steps, a checkpoint every 4 steps, all kept
BATCH, MICRO, STEPS = 12, 2, 16


def straight_config(digits, stage: int, **train) -> dict:
    """The config of straight_runs(stage); ``train`` overrides (e.g. ckpt_every) give a run that
    trains the same batches with the same updates."""
    return tiny_config(
        digits,
        train={
            "batch_size": BATCH,
            "micro_batch_size": MICRO,
            "max_steps": STEPS,
            "ckpt_every": 4,
            "keep_last": 5,
            **train,
        },
        # 2 data workers: a resume starts mid-epoch with each worker's stream part-read;
        # data.log_keys: each rank's keys per micro-batch (RUN/keys/rankN.jsonl)
        data={"num_workers": 2, "log_keys": True, "shuffle_buffer": 4},
        deepspeed={"zero_optimization": zero(stage)},
    )


@pytest.fixture(scope="session")
def straight_runs(once, digits16):
    """``straight_runs(stage)``: (run dir, config path) of straight_config(stage) on 2 ranks
    through the launcher, run once for the suite at the first test that asks for that stage: the
    uninterrupted runs the elastic (ZeRO-0, -2, -3), killed and preempted (ZeRO-0) runs are held
    to. A test that changes a run works on a copy (shutil.copytree)."""

    def build(stage: int, tmp: Path) -> tuple[Path, Path]:
        path = write_config(tmp / "config.json", straight_config(digits16, stage))
        r = run_cli(launch_cmd(2, path, tmp / "run"))
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        return tmp / "run", path

    return lambda stage: once(f"straight{stage}", lambda tmp: build(stage, tmp))


def listing(root: Path) -> set[str]:
    """Every path under ``root`` (bytecode caches aside)."""
    return {
        str(p)
        for p in root.rglob("*")
        if "__pycache__" not in p.parts and ".pytest_cache" not in p.parts
    }


@pytest.fixture(scope="session")
def one_rank_run(once, digits16):
    """``python pretrain/run.py`` (one process, 2 data workers) for 8 steps with a checkpoint
    every 2, the last 3 kept (steps 4, 6, 8): run once for the suite; the tests that damage its
    checkpoints or resume it with other settings work on a copy (shutil.copytree). Also what it
    wrote outside its run directory (under the repository and beside the shards): "outside"."""
    return once("one_rank", lambda tmp: _one_rank_run(tmp, digits16))


def _one_rank_run(tmp: Path, digits16) -> dict:
    cfg = tiny_config(
        digits16,
        train={"max_steps": 8, "ckpt_every": 2, "keep_last": 3},
        data={"num_workers": 2},
    )
    path = write_config(tmp / "c.json", cfg)
    out = tmp / "run"
    watched = [REPO, Path(digits16["train"]).parent]
    before = {w: listing(w) for w in watched}
    r = run_cli(
        [sys.executable, "pretrain/run.py", "--config", str(path), "--output-dir", str(out)]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    outside = sorted(p for w in watched for p in listing(w) - before[w])
    return {"run": out, "config": path, "cfg": cfg, "outside": outside}


def random_shards(out, sizes, prefix, label_of=lambda i: i % 10) -> list[str]:
    """One shard per entry of ``sizes``, random 16-px images, labels from ``label_of(index)``."""
    import numpy as np

    from mpp.data import WriterOptions, write_shards

    rng = np.random.default_rng(len(sizes))
    paths, start = [], 0
    for k, n in enumerate(sizes):
        samples = [
            (rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), label_of(start + i))
            for i in range(n)
        ]
        paths += write_shards(
            samples,
            out,
            f"{prefix}{k}",
            options=WriterOptions(max_count=n, seed=None, progress=False),
            class_names=[str(c) for c in range(10)],
        )
        start += n
    return paths


@pytest.fixture(scope="session")
def zero3_finetune(once, two_rank_runs, digits16):
    """One fine-tuning run through the launcher, checked by test_downstream (the CLI from a ZeRO-2
    pretraining run, its augmentations, results and weights) and test_scale (what a first
    cluster run meets): 3 ranks under ZeRO-3, one epoch of 96 training images of which a quarter
    are labelled 99 in a 10-class task, and 2 val shards of 5 and 40 images: rank 0 reads 5 (a
    full batch of 4 and a short one), rank 1 40 (10 batches), rank 2 no shard at all.
    {"run", "config", "init"}."""
    return once("finetune", lambda tmp: _zero3_finetune(tmp, two_rank_runs, digits16))


def _zero3_finetune(tmp: Path, two_rank_runs, digits16) -> dict:
    train = random_shards(
        tmp / "train", [24, 24, 24, 24], "t", lambda i: 99 if i % 4 == 0 else i % 10
    )
    val = random_shards(tmp / "val", [5, 40], "v")
    pre_dir, _ = two_rank_runs[2]
    raw = tiny_config(
        digits16,
        train={"batch_size": 12, "epochs": 1, "max_steps": None, "ckpt_every": 100},
        deepspeed={"zero_optimization": zero(3)},
        optim={"lr": 1e-3, "layer_decay": 0.75},
    )
    raw.pop("objective"), raw.pop("masking")
    raw["data"].update(train_shards=train, val_shards=val, num_workers=1)
    raw["finetune"] = {
        "mixup": 0.8,
        "cutmix": 1.0,
        "randaug_n": 2,
        "randaug_m": 9,
        "reprob": 0.25,
        "eval_batch_size": 4,
    }
    raw["init"] = str(pre_dir)
    path = write_config(tmp / "ft.json", raw)
    out = tmp / "ft"
    r = run_cli(launch_cmd(3, path, out, script="downstream/finetune.py"), timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return {"run": out, "config": raw, "init": pre_dir}


@pytest.fixture(scope="session")
def one_rank_probes(once, two_rank_runs, digits16):
    """k-NN and the linear probe of the ZeRO-2 pretraining run (two_rank_runs[2]) in one process
    each: {"config": probe config path, "knn": results, "linear_probe": results}; test_scale
    runs the same on 2 ranks."""
    return once("probes", lambda tmp: _one_rank_probes(tmp, two_rank_runs, digits16))


def _one_rank_probes(tmp: Path, two_rank_runs, digits16) -> dict:
    probe = {
        "name": "p",
        "init": str(two_rank_runs[2][0]),
        "model": {"name": "vit_tiny_patch4_16", "depth": 2, "embed_dim": 32, "num_heads": 2},
        "data": {
            "train_shards": digits16["train"],
            "val_shards": digits16["val"],
            "num_workers": 1,
        },
        "probe": {"epochs": 3, "batch_size": 128},
    }
    path = write_config(tmp / "probe.json", probe)
    results = {"config": path}
    for tool in ("knn", "linear_probe"):
        out = tmp / tool
        cmd = [sys.executable, f"downstream/{tool}.py", "--config", str(path), "--output-dir"]
        r = run_cli([*cmd, str(out)])
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        results[tool] = json.loads((out / "results.json").read_text())
    return results
