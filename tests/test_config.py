"""The config's refusals (mpp/config.py, mpp/sections.py, ``mpp config``): every problem of a
config said at once, each naming its key and where its value came from (the file, a ``--set``,
an argument of the Python API), and a near name offered for a mistyped one (issue 50, findings 4
and 9)."""

from __future__ import annotations

import pickle

import pytest

from mpp.config import Config, ConfigError, FinetuneConfig, load_config


def test_every_refusal_of_a_config_is_said_at_once():
    """Keys refused in three sections, then (their sections valid) the checks across them: each
    its own line, naming its key and the --set that made it; it once said the first alone. One
    refusal stays one line."""
    sets = ["optim.lr=1", "train.batch_size=0", "data.crop_scale=[0.9, 0.1]", "model.depth=0"]
    with pytest.raises(ConfigError) as e:
        load_config("mae_demo", sets)
    found = e.value.findings
    assert len(found) == 4, str(e.value)
    assert str(e.value).startswith("4 problems (all of them, each with its fix):\n  ")
    for key, said in (
        ("model.depth", "Input should be greater than 0 (got 0)"),
        ("data", "crop_scale must satisfy 0 < min <= max <= 1"),
        ("optim", "set lr or blr, not both (lr=1.0, blr=0.0015)"),
        ("train.batch_size", "Input should be greater than 0 (got 0)"),
    ):
        assert any(f": {key}: {said}" in f for f in found), (key, found)
    assert any(f.startswith("--set train.batch_size=0 (over ") for f in found), found
    # a value that each member of a union refuses: one line, the first member's
    with pytest.raises(ConfigError) as e:
        load_config("mae_demo", ['data.mean="x"'])
    (line,) = e.value.findings
    assert line.endswith("mae_demo.json): data.mean: Input should be a valid tuple (got 'x')")

    # across keys: ImageNet's mean and std for one channel, and model.in_chans against it
    with pytest.raises(ConfigError) as e:
        load_config("mae_demo", ["data.channels=1", "model.in_chans=3"])
    keys = [f.split(": ")[1] for f in e.value.findings]
    assert keys == ["data.mean", "data.std", "model.in_chans=3 but data.channels=1"], e.value
    assert all(f.startswith("--set data.channels=1 (over ") for f in e.value.findings[:2])

    with pytest.raises(ConfigError) as e:
        load_config("mae_demo", ["train.batch_size=0"])
    assert len(e.value.findings) == 1 and "\n" not in str(e.value)
    # a refusal travels between processes (a rank's, a job's) whole
    again = pickle.loads(pickle.dumps(ConfigError("a: b", "c: d")))
    assert again.findings == ["a: b", "c: d"] and str(again).count("\n") == 2


def test_an_api_error_names_the_argument_not_a_set(tmp_path):
    """mpp.pretrain's keyword arguments were blamed as ``--set data.train_shards=...``, which no
    one had typed (finding 9); the data checks after validation name them the same way."""
    import mpp

    out = str(tmp_path / "run")
    with pytest.raises(ConfigError) as e:
        mpp.pretrain("mae_demo", output_dir=out, train={"max_stepz": 3})
    assert str(e.value).startswith("the argument train.max_stepz=3 (over "), str(e.value)
    assert "train.max_stepz: unknown key (did you mean train.max_steps?)" in str(e.value)
    lost = str(tmp_path / "none-000000.tar")
    with pytest.raises(ConfigError) as e:
        mpp.pretrain("mae_demo", output_dir=out, data={"train_shards": lost})
    message = str(e.value)
    assert message.startswith(f'the argument data.train_shards="{lost}" (over '), message
    assert "--set" not in message and "data.train_shards: 1 shard(s) not found" in message
    # the command line's own still says --set
    cli = load_config("mae_demo", [f"data.train_shards={lost}"])
    from mpp.config import source_of

    assert source_of(cli, "data.train_shards").startswith(f"--set data.train_shards={lost} (")


def test_a_set_init_is_blamed_on_the_set(tmp_path, capsys):
    """``--set init=runs/mnie`` was blamed on finetune_demo.json (finding 9)."""
    from mpp.commands.finetune import main

    missing = str(tmp_path / "mnie")
    argv = ["--config", "finetune_demo", "--output-dir", str(tmp_path / "ft")]
    code = main([*argv, "--set", f"init={missing}"])
    err = capsys.readouterr().err
    assert code == 2 and f"error: --set init={missing} (over " in err, err
    assert f"finetune_demo.json): init: {missing}: no such file" in err, err


def test_a_mistyped_config_name_or_explained_key_gets_a_near_one(capsys):
    """``--config mae_dmeo`` and ``mpp config --explain train.max_step`` listed or said nothing
    near (finding 9); a key of another section is offered there (optim.warmup_steps)."""
    from mpp.commands.config import main

    with pytest.raises(ConfigError, match=r"mae_dmeo: config file not found .*did you mean mae_"):
        load_config("mae_dmeo")
    assert main(["mae_dmeo"]) == 2
    assert "did you mean mae_demo? shipped: " in capsys.readouterr().err
    for asked, near in (
        ("train.max_step", "train.max_steps"),
        ("data.valu_range", "data.value_range"),
        ("train.warmup_steps", "optim.warmup_steps"),
    ):
        assert main(["--explain", asked]) == 2
        err = capsys.readouterr().err
        assert f"error: {asked}: no such key" in err and f"(did you mean {near}?)" in err, err
    assert main(["--explain", "qqqq"]) == 2
    assert "did you mean" not in capsys.readouterr().err
    assert main(["--explain", "train.max_steps"]) == 0  # a real key: explained, as before
    assert "train.max_steps  [pretrain, finetune]" in capsys.readouterr().out


def test_sections_of_every_kind_collect_their_checks():
    """The model-level checks of each kind of config say each finding (fine-tuning's val set
    beside the shared ones)."""
    raw = {
        "data": {"train_shards": "x.tar", "channels": 1},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": 1},
    }
    with pytest.raises(ConfigError) as e:
        from mpp.config import validate

        validate(raw, "ft.json", FinetuneConfig)
    keys = [f.split(": ")[1] for f in e.value.findings]
    assert keys == ["data.mean", "data.std", "data.val_shards"], str(e.value)
    assert validate({**raw, "data": {"builtin": "digits"}}, "ok.json", Config)
