"""pretrain/run.py through the real DeepSpeed launcher on the CPU (gloo)."""

import json
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, cli_env, free_port, read_metrics, run_cli, tiny_config, write_config

from mpp.checkpoint.format import MARKER
from mpp.hub.encoder_file import load_encoder_file
from mpp.models import create_vit
from pretrain.run import main


def check_run(run_dir, steps):
    metrics = read_metrics(run_dir)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    for key in (
        "epoch",
        "samples",
        "loss",
        "lr",
        "imgs_per_sec",
        "data_wait_frac",
        "skipped",
        "acc",
        "frac_mask_token",
    ):
        assert key in metrics[-1], key
    assert (run_dir / "checkpoints" / f"step{steps:08d}" / MARKER).is_file()
    assert list((run_dir / "tb").iterdir()), "no TensorBoard event file"
    sd, kwargs = load_encoder_file(run_dir / "encoder.safetensors")
    enc = create_vit(kwargs.pop("name"), **kwargs)
    enc.load_state_dict(sd, strict=True)
    return metrics, sd


def test_no_op_is_built_and_no_shared_memory_is_left_behind(two_rank_runs):
    """DeepSpeed's CPU shm all-reduce (inference only) is skipped: no JIT build (a minute on a
    fresh machine) in the runs' own extensions cache, and none of the 66 MB /dev/shm buffers per
    rank it maps and never unlinks (305 of them, 20 GB, had piled up here)."""
    ext = two_rank_runs["extensions"]
    assert not ext.exists() or not any(ext.rglob("*.so")), sorted(ext.rglob("*"))
    assert len(two_rank_runs["ports"]) == 2
    for port in two_rank_runs["ports"]:
        assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"))


@pytest.mark.parametrize("stage", [2, 3])
def test_two_ranks_zero_stage_writes_metrics_checkpoint_and_encoder(two_rank_runs, stage):
    out, _ = two_rank_runs[stage]
    metrics, _ = check_run(out, 3)
    assert metrics[-1]["samples"] == 48  # global batch 16 = 2 ranks x 8
    ds_files = {p.name for p in (out / "checkpoints" / "step00000003").iterdir()}
    assert {
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    } <= ds_files


def test_zero2_and_zero3_train_the_same_model(two_rank_runs):
    """Same seed, same data: ZeRO only changes where the state lives, not the numbers."""
    m2, sd2 = check_run(two_rank_runs[2][0], 3)
    m3, sd3 = check_run(two_rank_runs[3][0], 3)
    assert [m["loss"] for m in m2] == pytest.approx([m["loss"] for m in m3], rel=1e-5)
    for k in sd2:
        torch.testing.assert_close(sd2[k], sd3[k], rtol=1e-4, atol=1e-5)


def test_two_node_loopback_job_equals_one_node(two_rank_runs, tmp_path):
    """Two launchers, --no_ssh, one rank each: the same losses as 1 node x 2 ranks."""
    ref_dir, cfg_path = two_rank_runs[2]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    port, out = str(free_port()), tmp_path / "two_node"

    def cmd(r):
        return [
            "deepspeed",
            "--hostfile",
            str(hostfile),
            "--no_ssh",
            f"--node_rank={r}",  # noqa: E731
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            port,
            "pretrain/run.py",
            "--config",
            str(cfg_path),
            "--output-dir",
            str(out),
        ]

    node1 = subprocess.Popen(
        cmd(1),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    r0 = run_cli(cmd(0))
    _, err1 = node1.communicate(timeout=240)
    assert r0.returncode == 0, r0.stderr[-3000:]
    assert node1.returncode == 0, err1[-3000:]
    assert "nnodes=2" in r0.stdout + r0.stderr
    metrics, _ = check_run(out, 3)
    assert [m["loss"] for m in metrics] == [m["loss"] for m in read_metrics(ref_dir)]


# ---- bad input: one line naming the key and the file, exit 2, no run directory ---------------

BAD = [
    ({"train": {"bogus": 1}}, "train.bogus: unknown key"),
    (
        {"train": {"on_nonfinite": "rollback", "skip_nonfinite": False}},
        "train: on_nonfinite='rollback' needs skip_nonfinite=true",
    ),
    ({"train": {"max_steps": "ten"}}, "train.max_steps"),
    ({"optim": {"lr": -1e-3}}, "optim.lr: Input should be greater than 0"),
    ({"train": {"batch_size": 15}}, "train.batch_size 15 is not divisible by the world size"),
    (
        {"deepspeed": {"zero_optimization": {"stage": 4}}},
        "deepspeed.zero_optimization.stage must be 0, 1, 2 or 3",
    ),
    ({"train": {"precision": "fp16"}}, "train.precision: train.precision 'fp16' needs a GPU"),
    (
        {"data": {"train_shards": "/nonexistent/train-{000000..000003}.tar"}},
        "data.train_shards: 4 shard(s) not found",
    ),
    # a held-out shard the previews or the monitor would read mid-run: refused up front, whole
    (
        {"data": {"val_shards": "/nonexistent/val-000000.tar"}},
        "data.val_shards: 1 of 1 shard(s) not found: /nonexistent/val-000000.tar",
    ),
    (
        {"monitor": {"val_shards": "/nonexistent/val-{000000..000001}.tar"}},
        "monitor.val_shards: 2 of 2 shard(s) not found: /nonexistent/val-000000.tar, ",
    ),
    # ... by either reader alone: the previews (the monitor off), the monitor (the previews off)
    (
        {"data": {"val_shards": "/nonexistent/val-000001.tar"}, "train": {"monitor_every": 0}},
        "data.val_shards: 1 of 1 shard(s) not found: /nonexistent/val-000001.tar",
    ),
    (
        {"data": {"val_shards": "/nonexistent/val-000002.tar"}, "train": {"preview_every": 0}},
        "data.val_shards: 1 of 1 shard(s) not found: /nonexistent/val-000002.tar",
    ),
    (
        {"objective": {"mask_ratio": 1.5}},
        "objective.mask_ratio: Input should be less than or equal to 1 (got 1.5)",
    ),
    (
        {"objective": {"colour": "red"}},
        "objective.colour: unknown key",
    ),
    ({"model": {"img_size": 18}}, "not divisible by patch_size 4"),
    (
        {"masking": {"strategy": "spiral"}},
        "masking.strategy: Input should be 'random', 'block', 'grid', 'center' or 'units' (got 'spiral')",
    ),
    (
        {"deepspeed": {"train_batch_size": 32}},
        "deepspeed.train_batch_size is derived from train.batch_size",
    ),
    ({"train": {"batch_size": -8}}, "train.batch_size: Input should be greater than 0"),
    ({"train": {"micro_batch_size": 5}}, "batch_size 16 is not divisible by micro_batch_size 5"),
    ({"train": {"max_steps": 0}}, "train.max_steps: Input should be greater than 0"),
    ({"train": {"log_every": 0}}, "train.log_every: Input should be greater than 0"),
    ({"train": {"precision": "fp8"}}, "train.precision: Input should be"),
    ({"optim": {"name": "sgd"}}, "optim.name: Input should be 'adam' or 'adamw'"),
    ({"optim": {"betas": [1.2, 0.9]}}, "betas must be in [0, 1)"),
    ({"optim": {"blr": 1e-3}}, "set lr or blr, not both"),
    (
        {"optim": {"weight_decay": -0.1}},
        "optim.weight_decay: Input should be greater than or equal to 0",
    ),
    ({"data": {"crop_scale": [0.8, 0.2]}}, "crop_scale must satisfy 0 < min <= max <= 1"),
    ({"data": {"hflip": 1.5}}, "data.hflip: Input should be less than or equal to 1"),
    ({"data": {"num_workers": -1}}, "data.num_workers: Input should be greater than or equal to 0"),
    ({"data": {"train_shards": 42}}, "data.train_shards"),
    ({"model": {"name": "vit_gigantic_patch4_16"}}, "unknown ViT variant 'vit_gigantic_patch4_16'"),
    ({"model": {"attn_backend": "flash"}}, "model.attn_backend: Input should be"),
    (
        {"objective": {"name": "simclr"}},
        "objective.name: Input should be 'hpm', 'mae', 'mpp' or 'simmim'",
    ),
    ({"objective": {"mask_token_prob": 0.5}}, "must sum to 1"),
    ({"masking": {"strategy": "grid"}, "objective": {"mask_ratio": 0.6}}, "grid"),
    ({"masking": {"strategy": "units", "unit_size": 3}}, "unit"),
    (
        {"deepspeed": {"zero_optimization": {"stage": "two"}}},
        "deepspeed.zero_optimization.stage must be 0, 1, 2 or 3",
    ),
    # DeepSpeed's own parser, before anything starts: it would ignore the first, refuse the
    # second only once the engine starts
    (
        {"deepspeed": {"zero_optimisation": {"stage": 1}}},
        "deepspeed.zero_optimisation: not a key DeepSpeed reads; did you mean zero_optimization?",
    ),
    (
        {"deepspeed": {"zero_optimization": {"stgae": 3}}},
        "deepspeed.zero_optimization.stgae: Extra inputs are not permitted",
    ),
    (  # a key of a section inside the section
        {"deepspeed": {"zero_optimization": {"offload_optimizer": {"device": "cpu", "devic": 1}}}},
        "deepspeed.zero_optimization.offload_optimizer.devic: Extra inputs are not permitted",
    ),
    (  # a check of the whole section: no location of its own
        {"deepspeed": {"zero_optimization": {"stage": 3, "compute_grad_norm": False}}},
        "deepspeed.zero_optimization: Value error, compute_grad_norm=false is supported only",
    ),
]


@pytest.mark.parametrize("change,message", BAD, ids=[m.split(":")[0][:30] for _, m in BAD])
def test_bad_config_is_one_line_exit_2_and_no_run_dir(tmp_path, digits16, capsys, change, message):
    cfg = tiny_config(digits16, train={"batch_size": 16})
    for section, values in change.items():
        cfg.setdefault(section, {})
        for k, v in values.items():
            if isinstance(v, dict) and isinstance(cfg[section].get(k), dict):
                cfg[section][k].update(v)
            else:
                cfg[section][k] = v
    if "world size" in message:  # only the launcher knows the world size: emulate 2 ranks
        import os

        os.environ["WORLD_SIZE"] = "2"
    path = write_config(tmp_path / "bad.json", cfg)
    out = tmp_path / "run"
    try:
        code = main(["--config", str(path), "--output-dir", str(out)])
    finally:
        import os

        os.environ.pop("WORLD_SIZE", None)
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert message in err and str(path) in err, err
    assert not out.exists()


def test_a_val_key_nothing_reads_is_not_looked_for(digits16):
    """Pretraining checks a held-out key only when its monitor or previews read it: a config may
    keep the val set of a later fine-tune, run where that set is not. Fine-tuning always reads
    data.val_shards."""
    from mpp.config import ConfigError, FinetuneConfig, validate
    from mpp.train.plan import check_data

    lost, val = "/nonexistent/val-000000.tar", digits16["val"]
    off = {"monitor_every": 0, "preview_every": 0}
    for data, monitor, train in (
        ({"val_shards": lost}, {}, off),  # nothing reads it
        ({"val_shards": lost}, {}, {"monitor_every": 0, "report_to": []}),  # no preview drawn
        ({"val_shards": lost}, {"val_shards": val}, {"preview_every": 0}),  # the monitor's own
        ({}, {"val_shards": lost}, {"monitor_every": 0}),  # the monitor off
    ):
        cfg = tiny_config(digits16, data=data, train=train)
        check_data(validate({**cfg, "monitor": monitor}), 16)
    raw = tiny_config(digits16, data={"val_shards": lost}, train=off)
    raw.pop("objective"), raw.pop("masking")
    with pytest.raises(ConfigError, match="data.val_shards: 1 of 1 shard"):
        check_data(validate(raw, "ft.json", cls=FinetuneConfig), 16)


def test_bad_config_through_the_cli_exits_2(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(
        json.dumps(
            {
                "optim": {"lr": 1e-3},
                "train": {"max_steps": 1, "typo": 3},
                "data": {"builtin": "digits"},
            }
        )
    )
    r = run_cli(
        ["python", "pretrain/run.py", "--config", str(path), "--output-dir", str(tmp_path / "run")]
    )
    assert r.returncode == 2 and f"{path}: train.typo: unknown key" in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_busy_port_and_missing_shards_are_one_line_each(tmp_path, digits16, capsys):
    """A port another process listens on (MASTER_PORT, as a launcher sets it) stops the run in one
    line naming it and a free one; missing shards are said before anything is created (no run
    directory): "mpp.parallel" never shows."""
    import socket

    path = write_config(tmp_path / "c.json", tiny_config(digits16))
    cmd = ["python", "pretrain/run.py", "--config", str(path), "--output-dir", str(tmp_path / "r")]
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = run_cli(cmd, env={"MASTER_PORT": str(port)})
    errors = [x for x in r.stderr.splitlines() if x.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1, r.stderr[-3000:]
    assert f"the launcher's port {port} is in use" in errors[0] and "--master_port" in errors[0]
    assert "Traceback" not in r.stderr

    # the rest through the command's main, in this process
    argv = cmd[2:]
    code = main([*argv, "--set", 'data.train_shards="/nowhere/x-{0..1}.tar"'])
    err = capsys.readouterr().err
    assert code == 2 and "data.train_shards: 2 shard(s) not found" in err
    assert not (tmp_path / "r").exists(), err

    # 16-bit PNGs with no data.value_range, the statistics "auto": refused as early, one line
    import io

    import numpy as np
    from PIL import Image

    from mpp.data import WriterOptions, write_shards

    png = io.BytesIO()
    Image.fromarray(np.full((16, 16), 40000, dtype=np.uint16)).save(png, format="PNG")
    (shard,) = write_shards(
        [(png.getvalue(), 0)] * 20, tmp_path / "s16", "s", options=WriterOptions(progress=False)
    )
    sets = [f"data.train_shards={shard}", "data.channels=1", 'data.mean="auto"', 'data.std="auto"']
    code = main([*argv, *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    errors = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert f"data.value_range: unset, but {shard} holds uint16 images" in errors[0]
    assert not (tmp_path / "r").exists()
    # ... and under the default 3 channels, which a 16-bit grey image does not fit: named too
    # (the check once skipped it, and the run started, then died of 100 skipped samples), with
    # the count that fits, the statistics that do not fit it and the range, in one refusal
    code = main([*argv, "--set", f"data.train_shards={shard}"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err[-3000:]
    assert "error: 4 problems (all of them, each with its fix):" in err, err
    for finding in (
        f"data.channels: 3, but the first image of {shard} holds a 16x16 uint16 array, not 3 "
        "channel(s): set data.channels=1",
        "data.mean: 3 values (ImageNet's), but the images hold 1 channel(s): give 1 or",
        "data.std: 3 values (ImageNet's), but the images hold 1 channel(s): give 1 or",
        f"data.value_range: unset, but {shard} holds uint16 images: say what maps to [0, 1] "
        "(e.g. [0, 65535])",
    ):
        assert finding in err, err
    assert not (tmp_path / "r").exists()
    # 8-bit RGB JPEGs under data.channels=1: refused as early, with no value-range advice (the
    # check once let every 8-bit misfit pass, and the run died of 100 skipped samples)
    jpg = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), 90, dtype=np.uint8)).save(jpg, format="JPEG")
    (shard,) = write_shards(
        [(jpg.getvalue(), 0)] * 20, tmp_path / "s8", "s", options=WriterOptions(progress=False)
    )
    sets = [f"data.train_shards={shard}", "data.channels=1", "data.mean=[0.5]", "data.std=[0.25]"]
    code = main([*argv, *[a for s in sets for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 2 and err.count("error:") == 1 and "Traceback" not in err, err[-3000:]
    assert (
        f"data.channels: 1, but the first image of {shard} holds a 16x16x3 uint8 array, not 1 "
        "channel(s): set data.channels=3\n"
    ) in err, err
    assert "data.mean: 1 value, but the images hold 3 channel(s)" in err, err
    assert "value_range" not in err, err
    assert not (tmp_path / "r").exists()


def test_bare_config_name_resolves_in_configs_dir(capsys, tmp_path):
    code = main(["--config", "mpp_b16", "--set", "train.bogus=1"])
    err = capsys.readouterr().err  # the key came from --set: said so, over which file
    assert code == 2 and "--set train.bogus=1 (over " in err
    assert "configs/mpp_b16.json): train.bogus: unknown key" in err
    # HPM's flat form files a key it does not know under its base: still the --set's
    code = main(["--config", "hpm_demo", "--set", "objective.hard_ration=0.5"])
    err = capsys.readouterr().err
    assert code == 2 and "--set objective.hard_ration=0.5 (over " in err, err
    assert "objective.hard_ration: unknown key (did you mean objective.hard_ratio?)" in err
    # ... but HPM's own key in the file's nested base is the file's, beside a valid --set of it
    hpm = json.loads((REPO / "configs" / "hpm_demo.json").read_text())
    hpm["objective"] = {"name": "hpm", "base": {"name": "mae", "hard_ratio": 0.5}}
    (tmp_path / "nested.json").write_text(json.dumps(hpm))
    code = main(["--config", str(tmp_path / "nested.json"), "--set", "objective.hard_ratio=0.6"])
    err = capsys.readouterr().err
    assert code == 2 and f"error: {tmp_path / 'nested.json'}: objective.base.hard_ratio:" in err
    # a key --set beside the file's nested base: HPM files it under base, named as written
    hpm["objective"] = {"name": "hpm", "base": {"name": "mae"}}
    (tmp_path / "nested.json").write_text(json.dumps(hpm))
    code = main(["--config", str(tmp_path / "nested.json"), "--set", "objective.bits=0"])
    err = capsys.readouterr().err
    assert code == 2 and "--set objective.bits=0 (over " in err, err
    assert "objective.bits: unknown key" in err, err


def test_demo_config_learns(tmp_path, demo_cache):
    """configs/mpp_demo.json on the built-in dataset: its MPP loss falls (first 25 steps)."""
    import json as _json

    from conftest import REPO as _REPO

    demo = _json.loads((_REPO / "configs" / "mpp_demo.json").read_text())
    assert demo["data"]["builtin"] == "digits" and demo["objective"]["name"] == "mpp"
    out = tmp_path / "demo"
    r = run_cli(
        [
            "python",
            "pretrain/run.py",
            "--config",
            "mpp_demo",
            "--output-dir",
            str(out),
            "--set",
            "train.stop_at_step=25",
            "--set",
            "train.log_every=5",
        ],
        env=demo_cache,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [m["loss"] for m in read_metrics(out, "train")]
    assert losses[-1] < 0.8 * losses[0], losses
