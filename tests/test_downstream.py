"""Fine-tuning, probes and exports: init kinds, layer decay, position-embedding resampling,
safe loading, bad input, and the CLIs through the real launcher."""

import json
import logging
import os
import pickle
from pathlib import Path

import pytest
import torch
from conftest import restamp, run_cli, tiny_config, write_config
from test_vit import timm_vit_keys

from mpp.config import ConfigError, FinetuneConfig, validate
from mpp.data.augment import mixup_cutmix, random_erasing, soft_targets
from mpp.features import knn_classify
from mpp.hub.encoder_file import save_weights
from mpp.hub.export import export
from mpp.hub.pretrained import load_into, load_pretrained
from mpp.models import create_vit, resample_abs_pos_embed
from mpp.objectives.classifier import Classifier
from mpp.train.optim import build_optimizer, lr_at, set_lr


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_checkpoints_give_the_exported_weights(two_rank_runs, stage):
    run_dir, _ = two_rank_runs[stage]
    exported, kwargs = load_pretrained(run_dir / "encoder.safetensors")
    for source in (run_dir / "checkpoints", run_dir / "checkpoints" / "step00000003"):
        sd, kw = load_pretrained(source)  # DeepSpeed's zero-to-fp32, under weights_only loads
        assert sd.keys() == exported.keys() and kw["name"] == kwargs["name"]
        for k in sd:
            torch.testing.assert_close(sd[k], exported[k], rtol=0, atol=0)
    assert load_pretrained(run_dir)[0].keys() == exported.keys()  # a run directory
    from test_preview import tb_images

    assert [e.step for e in tb_images(run_dir)[0]] == [2]  # the preview, under ZeRO-3 too


def test_layer_decay_lr_of_block_i_is_base_times_decay_to_depth_minus_i():
    cfg = validate(
        {
            "optim": {"lr": 1e-3, "layer_decay": 0.65},
            "train": {"max_steps": 1},
            "data": {"builtin": "digits"},
        },
        cls=FinetuneConfig,
    )
    depth = 4
    model = Classifier(
        create_vit("vit_tiny_patch4_16", depth=depth, embed_dim=32, num_heads=2, num_classes=10)
    )
    opt = build_optimizer(cfg, model)  # optim.layer_decay over model.encoder.blocks
    assert isinstance(opt, torch.optim.AdamW)
    base = lr_at(5, peak=1e-3, total=10, warmup=2)
    set_lr(opt, base)
    lr_of = {id(p): g["lr"] for g in opt.param_groups for p in g["params"]}
    params = dict(model.named_parameters())
    for i in range(depth):
        assert lr_of[id(params[f"encoder.blocks.{i}.attn.qkv.weight"])] == pytest.approx(
            base * 0.65 ** (depth - i)
        )
    assert lr_of[id(params["encoder.patch_embed.proj.weight"])] == pytest.approx(
        base * 0.65 ** (depth + 1)
    )
    assert lr_of[id(params["encoder.head.weight"])] == pytest.approx(base)


def test_finetuning_at_a_larger_size_starts_from_the_resampled_position_embedding(tmp_path):
    src = create_vit("vit_tiny_patch4_16", depth=1, embed_dim=32, num_heads=2)
    save_weights(
        src.state_dict(), tmp_path / "enc.safetensors", {"model": {"name": "vit_tiny_patch4_16"}}
    )
    big = create_vit(
        "vit_tiny_patch4_16", img_size=32, depth=1, embed_dim=32, num_heads=2, num_classes=5
    )
    load_into(big, tmp_path / "enc.safetensors")
    assert big.pos_embed.shape == (1, 1 + 64, 32)
    torch.testing.assert_close(
        big.pos_embed.data, resample_abs_pos_embed(src.pos_embed.data, (8, 8))
    )
    torch.testing.assert_close(big.pos_embed.data[:, 0], src.pos_embed.data[:, 0])  # cls kept
    torch.testing.assert_close(big.blocks[0].attn.qkv.weight, src.blocks[0].attn.qkv.weight)


class Payload:
    def __reduce__(self):
        return (Path.touch, (Path(os.environ["PAYLOAD_MARK"]),))


def test_a_pickled_payload_in_a_checkpoint_is_refused_not_executed(
    two_rank_runs, tmp_path, monkeypatch
):
    import shutil

    run_dir, _ = two_rank_runs[2]
    bad = tmp_path / "ckpt"
    shutil.copytree(run_dir / "checkpoints", bad)
    mark = tmp_path / "pwned"
    monkeypatch.setenv("PAYLOAD_MARK", str(mark))
    target = bad / "step00000003" / "mp_rank_00_model_states.pt"
    state = torch.load(target, weights_only=True)
    state["evil"] = Payload()
    torch.save(state, target)
    restamp(target.parent)
    with pytest.raises(pickle.UnpicklingError):
        load_pretrained(bad)
    assert not mark.exists()


@pytest.mark.parametrize(
    "init,match",
    [
        ("/nonexistent/run", "no such file or directory"),
        ("{tmp}/weights.txt", "unknown kind"),
        ("{tmp}/deeper.safetensors", "missing 1 encoder weights|blocks.1"),
        ("{tmp}/wider.safetensors", "has shape"),
    ],
)
def test_bad_init_is_a_clear_error_naming_the_path(tmp_path, init, match):
    (tmp_path / "weights.txt").write_text("x")
    shallow = create_vit("vit_tiny_patch4_16", depth=1, embed_dim=32, num_heads=2)
    save_weights(shallow.state_dict(), tmp_path / "deeper.safetensors")  # 1 block; the model has 2
    wide = create_vit("vit_tiny_patch4_16", depth=2, embed_dim=64, num_heads=2)
    save_weights(wide.state_dict(), tmp_path / "wider.safetensors")
    model = create_vit("vit_tiny_patch4_16", depth=2, embed_dim=32, num_heads=2, num_classes=3)
    path = init.format(tmp=tmp_path)
    with pytest.raises((ValueError, FileNotFoundError), match=match) as err:
        load_into(model, path)
    assert path in str(err.value)


def test_class_count_that_does_not_match_the_shards(digits16, tmp_path):
    from mpp.transfer.finetune import build_classifier

    raw = tiny_config(digits16)
    raw.pop("objective"), raw.pop("masking")
    raw["finetune"] = {"num_classes": 12}
    raw["data"]["val_shards"] = digits16["val"]
    cfg = validate(raw, "ft.json", cls=FinetuneConfig)
    with pytest.raises(ConfigError, match="finetune.num_classes: 12 does not match the 10 classes"):
        build_classifier(cfg)


def test_own_train_shards_without_val_shards_are_refused_before_anything_runs(
    digits16, tmp_path, capsys
):
    """Unset, val_shards meant the built-in digits' validation split: a fine-tune or a probe on
    other data was scored on the digits. Now each command stops at its config, naming the key."""
    from mpp.commands import finetune, knn

    for main, config in ((finetune.main, "finetune_demo"), (knn.main, "linear_demo")):
        out = tmp_path / config
        argv = ["--config", config, "--set", f"data.train_shards={digits16['train']}"]
        assert main([*argv, "--output-dir", str(out)]) == 2
        errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
        # blamed on the --set that made the check fail, over the file
        made = f"--set data.train_shards={digits16['train']} (over "
        assert len(errors) == 1 and errors[0].startswith(f"error: {made}"), errors
        assert f"configs/{config}.json): data.val_shards: not set" in errors[0]
        assert not out.exists()
        argv += ["--set", f"data.val_shards={digits16['val']}", "--set", "init=nowhere"]
        assert main([*argv, "--output-dir", str(out)]) == 2  # past it: the next check's refusal
        assert "data.val_shards" not in capsys.readouterr().err


def test_missing_shards_stop_finetune_and_the_probes_before_anything_runs(
    digits16, tmp_path, capsys, caplog
):
    """As pretraining: any missing validation shard, or no training shard at all, is one line
    naming the key and the file, exit 2, nothing created (not a traceback at the first
    evaluation, not a class count the absent shards could not give)."""
    from mpp.commands import finetune, knn, probe

    caplog.set_level(logging.WARNING, logger="mpp")  # an earlier test may have raised the root's
    val, train = digits16["val"], digits16["train"]
    nowhere = str(tmp_path / "nowhere" / "train-{000000..000001}.tar")
    for main, config in ((finetune.main, "finetune_demo"), (knn.main, "linear_demo")):
        for sets, said in (
            ([f"data.train_shards={train}", "data.val_shards=/nowhere/val.tar"], "data.val_shards"),
            ([f"data.train_shards={nowhere}", f"data.val_shards={val}"], "data.train_shards"),
        ):
            out = tmp_path / config
            argv = ["--config", config, "--output-dir", str(out), "--set", "init=scratch"]
            assert main([*argv, *(x for s in sets for x in ("--set", s))]) == 2
            errors = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error:")]
            assert len(errors) == 1 and f"): {said}: " in errors[0], errors
            assert ("/nowhere/val.tar" if said == "data.val_shards" else "train-000000") in errors[
                0
            ]
            assert not out.exists()

    # some training shards missing: the probes leave them out as pretraining and fine-tuning do
    more = train.replace("..000007}", "..000008}")  # train-000008.tar does not exist
    small = ["model.name=vit_tiny_patch4_16", "model.depth=1", "model.embed_dim=32"]
    sets = [f"data.train_shards={more}", f"data.val_shards={val}", "init=scratch", *small]
    for main, out, extra in (
        (knn.main, tmp_path / "knn", []),
        (probe.main, tmp_path / "linear", ["probe.epochs=1"]),
    ):
        argv = ["--config", "linear_demo", "--output-dir", str(out)]
        caplog.clear()
        assert main([*argv, *(x for s in sets + extra for x in ("--set", s))]) == 0
        said = [r.getMessage() for r in caplog.records if "not found" in r.getMessage()]
        assert len(said) == 1 and "1 of 9 shards not found, training without" in said[0], said
        assert said[0].endswith("train-000008.tar")
        assert json.loads((out / "results.json").read_text())["num_train"] == 1497


def test_mixup_cutmix_targets_and_label_smoothing():
    labels = torch.tensor([0, 1, 2, 3])
    t = soft_targets(labels, 4, 0.1)
    assert torch.allclose(t.sum(1), torch.ones(4)) and t[0, 0] == pytest.approx(0.925)
    images = torch.randn(4, 3, 8, 8)
    torch.manual_seed(0)
    mixed, targets, lam = mixup_cutmix(images, t, mixup=0.8, cutmix=0.0)
    torch.testing.assert_close(mixed, lam * images + (1 - lam) * images.flip(0))
    torch.testing.assert_close(targets, lam * t + (1 - lam) * t.flip(0))
    torch.manual_seed(1)
    cut, targets, lam = mixup_cutmix(images, t, mixup=0.0, cutmix=1.0)
    from_other = (cut == images.flip(0)).all(1).float().mean().item()  # fraction of pixels pasted
    assert 1 - lam == pytest.approx(from_other, abs=1e-6)


def test_random_erasing_rate_and_area():
    torch.manual_seed(0)
    x = torch.zeros(2000, 1, 16, 16)
    erased = random_erasing(x, prob=0.25) != 0
    frac = erased.flatten(1).any(1).float().mean().item()
    assert frac == pytest.approx(0.25, abs=0.03)
    area = erased.flatten(1).float().mean(1)[erased.flatten(1).any(1)]
    assert area.min() >= 0.02 * 0.5 and area.max() <= 1 / 3 + 0.05


def test_knn_votes_by_similarity():
    train = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0]])
    y = torch.tensor([0, 0, 1])
    res = knn_classify(
        train, y, torch.tensor([[1.0, 0.05], [0.05, 1.0]]), torch.tensor([0, 1]), 2, k=2
    )
    assert res["top1"] == 100.0


def test_timm_export_has_timms_layout(two_rank_runs, tmp_path):
    from safetensors.torch import load_file

    folder = export(two_rank_runs[3][0], "timm", tmp_path / "timm")
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_args"] == {
        "img_size": 16,
        "patch_size": 4,
        "in_chans": 3,
        "embed_dim": 32,
        "depth": 2,
        "num_heads": 2,
        "mlp_ratio": 4.0,  # the encoder states its whole architecture
        "qkv_bias": True,
        "num_classes": 0,
        "global_pool": "token",
        "class_token": True,
        "fc_norm": False,
    }
    sd = load_file(folder / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in sd.items()} == timm_vit_keys(
        depth=2, dim=32, patch=4, num_patches=16, mlp=128
    )


def test_finetune_and_probes_through_the_clis(zero3_finetune, one_rank_probes, tmp_path, capsys):
    """A ZeRO-3 fine-tune through the launcher from a ZeRO-2 pretraining run, with mixup, cutmix,
    RandAugment and random erasing (conftest.zero3_finetune: 3 ranks, one epoch); then k-NN and
    the linear probe of the pretraining run (conftest.one_rank_probes)."""
    out, pre_dir = zero3_finetune["run"], zero3_finetune["init"]
    res = json.loads((out / "results.json").read_text())
    assert {"top1", "top5", "epoch", "init"} <= res.keys() and res["init"] == str(pre_dir)
    assert res["init_read"] == str(pre_dir / "encoder.safetensors") and res["init_finished"]
    assert res["last"]["num_val"] == 45  # every rank's share, every val sample once
    assert 0.0 <= res["top1"] <= 100.0 and res["top5"] >= res["top1"]
    assert (out / "model_best.safetensors").is_file() and (out / "model_last.safetensors").is_file()
    assert any("val_top1" in line for line in (out / "metrics.jsonl").read_text().splitlines())

    for tool in ("knn", "linear_probe"):
        res = one_rank_probes[tool]
        assert res["num_train"] == 1497 and res["num_val"] == 300 and 0 <= res["top1"] <= 100
        assert res["eval"] == {"knn": "knn", "linear_probe": "linear"}[tool]
        assert res["init"] == str(pre_dir)
    from mpp.commands.knn import main as knn_main  # in this process

    argv = ["--config", str(one_rank_probes["config"]), "--set", "init=/missing"]
    code = knn_main([*argv, "--output-dir", str(tmp_path / "x")])
    assert code == 2 and "init: /missing: no such file" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_the_probes_skip_and_count_labels_outside_the_classes(tmp_path):
    """A label >= num_classes is skipped and counted by k-NN and every linear-probe protocol, as
    fine-tuning's loader does (mpp.data.loader.select_image), instead of failing in the vote or
    the loss; results.json reports the count. Train: 2 of 12 labelled 10 and 11; val: 1 of 8."""
    from conftest import random_shards

    from mpp.commands import knn, probe

    train = random_shards(
        tmp_path / "t", [12], "t", lambda i: 10 + i // 6 if i % 6 == 0 else i % 10
    )
    val = random_shards(tmp_path / "v", [8], "v", lambda i: 11 if i == 3 else i)
    cfg = {
        "model": {"name": "vit_tiny_patch4_16", "depth": 1, "embed_dim": 16, "num_heads": 1},
        "data": {"train_shards": train, "val_shards": val, "num_workers": 0, "num_classes": 10},
        "probe": {"epochs": 1, "batch_size": 4},
    }
    path = write_config(tmp_path / "p.json", cfg)
    runs = [("knn", knn.main, []), *[(p, probe.main, ["--protocol", p]) for p in ("fast", "mae")]]
    for name, main, extra in runs:
        out = tmp_path / name
        assert main(["--config", str(path), "--output-dir", str(out), *extra]) == 0
        res = json.loads((out / "results.json").read_text())
        assert res["num_val"] == 7 and res["skipped"] == 3 and 0 <= res["top1"] <= 100, res
        # the samples kept, every protocol (mae: its pass of 3 steps of 4 reads 12, skips 2)
        assert res["num_train"] == 10, res


def test_a_data_error_on_one_rank_ends_every_rank(tmp_path):
    """Rank 1's validation shard holds 120 labels outside the classes in a row: its k-NN stops with
    a DataError, and rank 0, which was left waiting in the feature gather (a hang), ends with it.
    The ranks are started as a scheduler's tasks are (no launcher to end the others): each exits
    1 within the time limit, with the one-line error of the job driver."""
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from conftest import random_shards

    from mpp.parallel.launch import free_port

    train = random_shards(tmp_path / "t", [8], "t")
    val = random_shards(tmp_path / "v", [4, 120], "v", lambda i: i % 10 if i < 4 else 99)
    cfg = {
        "model": {"name": "vit_tiny_patch4_16", "depth": 1, "embed_dim": 16, "num_heads": 1},
        "data": {"train_shards": train, "val_shards": val, "num_workers": 0, "num_classes": 10},
    }
    path = write_config(tmp_path / "p.json", cfg)
    cmd = [sys.executable, "-m", "mpp.commands.knn", "--config", str(path), "--output-dir"]
    world = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2"}
    rank_of = lambda r: {"RANK": str(r), "LOCAL_RANK": str(r)}  # noqa: E731
    with ThreadPoolExecutor(2) as pool:  # a rank each, neither watching the other
        ranks = [
            pool.submit(run_cli, [*cmd, str(tmp_path / "out")], 120, {**world, **rank_of(r)})
            for r in range(2)
        ]
        ended = [rank.result() for rank in ranks]
    for r, done in enumerate(ended):  # a hang: subprocess.TimeoutExpired
        errors = [x for x in done.stderr.splitlines() if x.startswith("error:")]
        assert done.returncode == 1 and len(errors) == 1, (r, done.returncode, done.stderr[-3000:])
        assert "consecutive" in errors[0] and ("rank 1: " in errors[0]) == (r == 0), errors


def test_a_fresh_head_is_initialised_as_in_maes_fine_tuning():
    """MAE's main_finetune: trunc_normal_(head.weight, std=2e-5), zero bias (not xavier)."""
    torch.manual_seed(0)
    model = Classifier(
        create_vit("vit_tiny_patch4_16", depth=1, embed_dim=64, num_heads=2, num_classes=1000)
    )
    w, b = model.encoder.head.weight, model.encoder.head.bias
    assert w.std().item() == pytest.approx(2e-5, rel=0.02)  # 64,000 draws
    assert w.mean().abs().item() < 1e-6 and torch.count_nonzero(b) == 0


def test_hpm_recipes_match_the_official_scripts():
    """HPM's released pretraining trains without norm_pix_loss; its fine-tuning uses layer decay 0.8."""
    from mpp.build import build_objective
    from mpp.config import load_config

    pre = load_config(
        "hpm_b16",
        ["model.depth=1", "model.img_size=32", "objective.decoder_depth=1", "data.builtin=digits"],
    )
    assert pre.objective.base.norm_pix_loss is False
    assert build_objective(pre).base.norm_pix_loss is False
    digits = ["data.builtin=digits"]
    assert load_config("finetune_hpm_b16", digits, cls=FinetuneConfig).optim.layer_decay == 0.8
    assert (
        load_config("finetune_b16", digits, cls=FinetuneConfig).optim.layer_decay == 0.65
    )  # MAE's


def test_downstream_follows_its_encoder_and_says_what_it_read(tmp_path, digits16):
    """A pretraining run at 32 px of the 16-px variant (python pretrain/run.py, 4 steps); k-NN
    with a config that leaves model.img_size unset takes 32 from it (its model.json says so, its
    config.json stays as loaded, no resampling); set to 16 on purpose, the position embeddings are resampled with one line; from
    the same run stopped early (no export, a stop recorded) one warning, and results.json says
    which checkpoint it read and that the run had not finished."""
    import shutil

    pre = tmp_path / "pre"
    cfg = tiny_config(digits16, model={"img_size": 32}, train={"max_steps": 4, "ckpt_every": 2})
    path = tmp_path / "pre.json"
    path.write_text(json.dumps(cfg))
    r = run_cli(["python", "pretrain/run.py", "--config", str(path), "--output-dir", str(pre)])
    assert r.returncode == 0, r.stderr[-3000:]

    probe = {
        "name": "p",
        "model": {"name": "vit_tiny_patch4_16", "depth": 2, "embed_dim": 32, "num_heads": 2},
        "data": {"train_shards": digits16["train"], "val_shards": digits16["val"]},
    }
    probe_path = tmp_path / "probe.json"
    probe_path.write_text(json.dumps(probe))

    def knn(init, out, *sets):
        cmd = ["python", "downstream/knn.py", "--config", str(probe_path), "--set", f"init={init}"]
        r = run_cli([*cmd, *[a for s in sets for a in ("--set", s)], "--output-dir", str(out)])
        assert r.returncode == 0, r.stderr[-3000:]
        saved = json.loads((out / "model.json").read_text())
        loaded = json.loads((out / "config.json").read_text())["model"]
        assert loaded["img_size"] == (16 if "model.img_size=16" in sets else None), loaded
        assert loaded["patch_size"] is None and loaded["norm_eps"] is None, loaded
        return r.stderr, json.loads((out / "results.json").read_text()), saved

    err, res, saved = knn(pre, tmp_path / "k32")
    assert saved["img_size"] == 32 and "resampled" not in err, err[-2000:]
    assert res["init_read"] == str(pre / "encoder.safetensors")
    assert res["init_step"] == 4 and res["init_finished"] is True

    err, _, saved = knn(pre, tmp_path / "k16", "model.img_size=16")
    assert saved["img_size"] == 16
    lines = [x for x in err.splitlines() if "position embeddings resampled" in x]
    assert len(lines) == 1 and "from its 8x8 patches to the model's 4x4" in lines[0], err[-2000:]

    stopped = tmp_path / "stopped"
    shutil.copytree(pre, stopped)
    (stopped / "encoder.safetensors").unlink()
    (stopped / "preempted.json").write_text('{"step": 4, "signal": "SIGINT"}\n')
    err, res, _ = knn(stopped, tmp_path / "k_stopped")
    warned = [x for x in err.splitlines() if "did not finish" in x]
    assert len(warned) == 1, err[-2000:]
    assert res["init_finished"] is False and res["init_step"] == 4
    assert res["init_read"] == str(stopped / "checkpoints" / "step00000004")
