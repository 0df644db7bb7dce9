"""One front door (issue 32 §1): the public names of ``import mpp`` stay put, README's snippet runs
as written, the ``mpp`` command lists its tools, and a wheel installed into a fresh environment
works from an empty directory (its configs, ``mpp doctor --quick``, a two-rank launcher run)."""

from __future__ import annotations

import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, cli_env, free_port, read_metrics, run_cli
from PIL import Image

import mpp

PUBLIC = {
    "create_model": ["name", "pretrained", "overrides"],
    "load_encoder": ["source"],
    "create_objective": ["name", "encoder", "mask_generator", "mean", "std", "kwargs"],
    "load_config": ["path", "overrides", "cls"],
    "pretrain": ["config", "output_dir", "resume", "restart", "overrides", "sections"],
    "finetune": ["config", "init", "output_dir", "resume", "restart", "overrides", "sections"],
}


def test_the_public_names_and_their_parameters_stay_put():
    assert set(mpp.__all__) == {*PUBLIC, "__version__"}
    for name, params in PUBLIC.items():
        assert list(inspect.signature(getattr(mpp, name)).parameters) == params, name
    with pytest.raises(AttributeError, match="has no attribute 'pretrained'"):
        mpp.pretrained  # noqa: B018  an old module path is not a name of the API


def test_the_readmes_snippet_runs_as_written(tmp_path, monkeypatch, capfd):
    """... and leaves the notebook as it found it (issue 50, finding 9): no process group, so no
    ``[rank0]:`` before every line of a later traceback (a group there before is the caller's:
    kept), and no DeepSpeed chatter on stdout (its zero-to-fp32 converter's "Processing zero
    checkpoint ..." at the end of each ZeRO run)."""
    import torch.distributed as dist

    from mpp.parallel.distributed import ONE_PROCESS_VARS

    had_group = dist.is_initialized()  # an earlier test in this worker (dist_group)
    text = (REPO / "README.md").read_text()
    snippet = re.search(r"```python\n(import mpp\n.*?)```", text, re.S)[1]
    monkeypatch.chdir(tmp_path)  # its runs/ lands here
    monkeypatch.delenv("MPP_VERBOSE", raising=False)
    hook, env = sys.excepthook, {k: os.environ.get(k) for k in ONE_PROCESS_VARS}
    out: list[str] = []
    exec(compile(snippet, "README.md", "exec"), {"print": lambda *a: out.append(a)})
    ((top1, ratio),) = out
    assert 0 <= top1 <= 100 and ratio == 0.75
    assert dist.is_initialized() == had_group and sys.excepthook is hook
    assert {k: os.environ.get(k) for k in ONE_PROCESS_VARS} == env
    stdout = capfd.readouterr().out
    assert "Processing zero checkpoint" not in stdout and "[INFO]" not in stdout, stdout
    assert (tmp_path / "runs" / "api-mpp" / "encoder.safetensors").is_file()
    assert json.loads((tmp_path / "runs" / "api-ft" / "results.json").read_text())["top1"] == top1


NOTEBOOK = """
import os, sys
import torch.distributed as dist
import mpp

from mpp.parallel.distributed import ONE_PROCESS_VARS

hook, env = sys.excepthook, {k: os.environ.get(k) for k in ONE_PROCESS_VARS}
mpp.pretrain("mpp_demo", sys.argv[1], train={"max_steps": 1, "monitor_every": 0})
assert not dist.is_initialized() and sys.excepthook is hook
assert {k: os.environ.get(k) for k in ONE_PROCESS_VARS} == env
try:
    raise ValueError("a later, unrelated error")
except ValueError:
    sys.excepthook(*sys.exc_info())
print("after the run")
"""


def test_an_api_run_leaves_no_process_group_and_no_deepspeed_chatter(tmp_path):
    """Issue 50, finding 9, in a fresh process as a notebook's: after ``mpp.pretrain`` (ZeRO-2:
    DeepSpeed's zero-to-fp32 reads its checkpoint at the end) torch.distributed is no longer
    initialised, a later traceback has no ``[rank0]:`` on every line, and stdout holds none of
    DeepSpeed's lines. Before: "Processing zero checkpoint ..." and a dozen more on stdout, the
    group and its excepthook left behind."""
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK)
    r = run_cli(["python", str(script), str(tmp_path / "run")], env={"MPP_VERBOSE": ""})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.endswith("after the run\n"), r.stdout
    for chatter in ("Processing zero checkpoint", "[INFO]", "[WARNING]", "Reconstructed"):
        assert chatter not in r.stdout, r.stdout
    assert "ValueError: a later, unrelated error" in r.stderr and "[rank0]" not in r.stderr


def test_a_refused_run_raises_its_whole_message_and_prints_nothing(tmp_path, monkeypatch, capfd):
    """One call per job (mpp.jobs): the API raises the named error itself, whose message names
    the key, the value's origin (the argument: no --set was typed) and the file; nothing reaches
    stderr, nothing is created."""
    from mpp.config import ConfigError

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        mpp.pretrain(
            "mae_demo", "runs/x", data={"train_shards": "data/mine/t-{000000..000001}.tar"}
        )
    assert str(e.value) == (
        'the argument data.train_shards="data/mine/t-{000000..000001}.tar" (over '
        f"{REPO / 'configs' / 'mae_demo.json'}): data.train_shards: 2 shard(s) not found, "
        "first: data/mine/t-000000.tar"
    )
    with pytest.raises(ConfigError, match="train.max_step: unknown key"):
        mpp.finetune("finetune_demo", train={"max_step": 3})
    with pytest.raises(ConfigError, match="resume and restart: choose one"):
        mpp.pretrain("mae_demo", resume="auto", restart=True)
    assert capfd.readouterr().err == "" and not (tmp_path / "runs").exists()


def test_mpp_lists_its_commands_and_each_is_the_tools_own():
    from mpp.commands import COMMANDS

    r = subprocess.run(
        [sys.executable, "-m", "mpp", "--help"],
        capture_output=True,
        text=True,
        env=cli_env(),
    )
    assert r.returncode == 0
    listed = re.findall(r"^  (\w+)  ", r.stdout, re.M)
    assert listed == list(COMMANDS) and {
        "pretrain",
        "finetune",
        "probe",
        "knn",
        "ablate",
        "export",
        "plan",
        "doctor",
        "shards",
        "viz",
        "demo",
    } <= set(listed)
    r = subprocess.run(
        [sys.executable, "-m", "mpp", "probe", "--help"],
        capture_output=True,
        text=True,
        env=cli_env(),
    )
    assert (
        r.returncode == 0 and r.stdout.startswith("usage: mpp probe") and "--protocol" in r.stdout
    )


def test_a_wheel_works_from_an_empty_directory(tmp_path):
    """Built, installed without its dependencies into a fresh environment that borrows this
    one's (not this clone's mpp), then run from an empty directory."""
    wheels, src = tmp_path / "wheels", tmp_path / "src"
    # built from a copy: a build in the clone would leave build/ behind
    shutil.copytree(REPO / "mpp", src / "mpp", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(wheels),
            str(src),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    env_dir = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True)
    site = next((env_dir / "lib").glob("python*/site-packages"))
    ours = next(
        Path(p)
        for p in sys.path
        if p.endswith("site-packages") and (Path(p) / "deepspeed").is_dir()
    )
    (site / "borrowed.pth").write_text(f"{ours}\n")  # dependencies only: no .pth of ours runs
    python = env_dir / "bin" / "python"
    wheel = next(wheels.glob("mpp-*.whl"))
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            str(wheel),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    (env_dir / "bin" / "mpp").write_text(
        f"#!{python}\nimport sys\nfrom mpp.commands import main\nsys.exit(main())\n"
    )
    (env_dir / "bin" / "deepspeed").write_text(
        f"#!{python}\nfrom deepspeed.launcher.runner import main\nmain()\n"
    )
    for script in ("mpp", "deepspeed"):
        (env_dir / "bin" / script).chmod(0o755)
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {**cli_env(), "PATH": f"{env_dir / 'bin'}{os.pathsep}{cli_env()['PATH']}"}

    def run(*cmd: str, timeout: int = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            list(cmd), cwd=empty, env=env, capture_output=True, text=True, timeout=timeout
        )

    r = run(
        str(python),
        "-c",
        "import mpp.config as c, mpp; print(mpp.__file__); print(c.resolve_config_path('mae_b16'))",
    )
    assert r.returncode == 0 and str(site) in r.stdout and "mae_b16.json" in r.stdout, (
        r.stdout + r.stderr
    )
    assert run("mpp", "--help").stdout.startswith("usage: mpp COMMAND")
    r = run("mpp", "doctor", "--quick", "--out", "doctor")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    rows = json.loads((empty / "doctor" / "doctor.json").read_text())["rows"]
    assert [row["verdict"] for row in rows if row["check"].startswith("launcher")] in (["pass"], [])
    assert not any(row["verdict"] == "fail" for row in rows)
    cmd = [
        "deepspeed",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),
        "--module",
        "mpp.commands.pretrain",
    ]
    # a user's own images: 4 class folders of 64-px JPEGs and PNGs written by PIL
    rng = np.random.default_rng(0)
    for split, count in (("train", 12), ("val", 3)):
        for c in range(4):
            folder = empty / "photos" / split / f"class{c}"
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8) // (c + 1)
                img = Image.fromarray(pixels).resize((64, 64), Image.Resampling.BICUBIC)
                img.save(folder / f"{i}.{'jpg' if i % 2 else 'png'}")
    assert run("mpp", "shards", "--help").stdout.startswith("usage: mpp shards")
    specs = {}
    for split in ("train", "val"):
        r = run("mpp", "shards", f"photos/{split}", "data", "--prefix", split, "--max-count", "16")
        assert r.returncode == 0, r.stderr[-2000:]
        specs[split] = r.stdout.split(" to ")[-1].strip()  # "wrote N samples, 4 classes to SPEC"
    assert specs["train"] == "data/train-{000000..000002}.tar", specs

    own = ["--set", f"data.train_shards={specs['train']}", "--set", "train.monitor_every=0"]
    pretrain = [
        *cmd,
        "--config",
        "mae_demo",
        *own,
        "--set",
        "model.img_size=64",
        "--set",
        "train.log_every=1",
    ]
    pretrain += [
        "--set",
        "train.batch_size=8",
        "--set",
        "train.ckpt_every=2",
        "--output-dir",
        "run",
    ]
    r = run(*pretrain, "--set", "train.max_steps=2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "going on from it" not in r.stderr
    # the same command again, further: it goes on from its checkpoint, saying so
    r = run(*pretrain, "--set", "train.max_steps=4")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "run holds a checkpoint (step00000002): going on from it" in r.stderr
    steps = [m["step"] for m in read_metrics(empty / "run") if "loss" in m]
    assert steps == [1, 2, 3, 4], steps
    assert json.loads((empty / "run" / "model.json").read_text())["img_size"] == 64

    # k-NN with the shipped config, which leaves the size unset: 64 px from init, stated in its
    # model.json; its config.json is the config as loaded
    knn = ["mpp", "knn", "--config", "linear_demo", "--set", "init=run", *own[:2]]
    r = run(*knn, "--set", f"data.val_shards={specs['val']}", "--output-dir", "knn")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((empty / "knn" / "model.json").read_text())["img_size"] == 64
    assert json.loads((empty / "knn" / "config.json").read_text())["model"]["img_size"] is None
    res = json.loads((empty / "knn" / "results.json").read_text())
    assert res["init_finished"] is True and res["init_step"] == 4 and res["num_val"] == 12

    # exported with the user's usual permissions, reloaded by transformers at 64 px
    r = run("mpp", "export", "run", "--format", "hf", "--out", "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    from transformers import ViTModel

    hf = ViTModel.from_pretrained(empty / "hf", add_pooling_layer=False)
    assert hf.config.image_size == 64 and hf.config.patch_size == 4  # mae_demo's variant
    umask = os.umask(0)
    os.umask(umask)
    for f in [*(empty / "hf").iterdir(), empty / "run" / "encoder.safetensors"]:
        assert f.stat().st_mode & 0o777 == 0o666 & ~umask, f


def test_a_config_key_explains_itself_from_its_docstring():
    from mpp.commands.config import explain, main

    (text,) = explain("data.value_range")
    assert "[pretrain, finetune, probe]" in text and "never an implicit 255" in text
    (hpm,) = explain("objective.teacher_view")
    assert "(HPMConfig)" in hpm and 'default: "visible"' in hpm
    assert explain("objective.base.bits") and explain("masking.min_aspect")
    assert main(["--explain", "data.nope"]) == 2
