"""The runs the shipped ``*_demo`` configs make (pretraining with each objective, fine-tuning, a
probe; 2 steps each), through every tool that takes a run: export to safetensors / timm / Hugging
Face (loaded back by transformers), viz, k-NN, linear probe, fine-tuning's ``init``, ``--resume
auto``. A tool that cannot serve a kind of run exits non-zero with one ``error:`` line.

Only step counts, epochs and output folders are overridden, never the architecture, except where
a test says so (the probe and fine-tune configs are patch 8, the MAE / HPM demos patch 4)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import launcher, read_metrics, run_cli
from PIL import Image
from safetensors.torch import load_file

from mpp.commands.job import probe_main as run_probe
from mpp.hub import export
from mpp.hub.pretrained import load_pretrained
from mpp.models import create_vit
from mpp.models.vit import VisionTransformer
from mpp.tools import viz
from mpp.train.panels import picture_size

transformers = pytest.importorskip("transformers")

PRETRAIN = ("mpp", "mae", "hpm")
TWO_STEPS = ["--set", "train.max_steps=2"]


@pytest.fixture(autouse=True)
def _demo_data(demo_cache, monkeypatch):
    """Every CLI run here reads the session's built-in digits ($MPP_CACHE), not $HOME's."""
    monkeypatch.setenv("MPP_CACHE", demo_cache["MPP_CACHE"])


@pytest.fixture(scope="module")
def demo_runs(tmp_path_factory, demo_cache):
    """{kind: run directory}: the demo's pretraining through the launcher on 2 ranks (as
    ``make demo``), MAE and HPM on one process, a fine-tune and a k-NN run from the MPP run."""
    tmp = tmp_path_factory.mktemp("demo")
    with pytest.MonkeyPatch.context() as mp:
        # the builtin digits, built once for the session, not in $HOME
        mp.setenv("MPP_CACHE", demo_cache["MPP_CACHE"])
        runs = {kind: tmp / kind for kind in (*PRETRAIN, "finetune", "knn")}
        commands = {
            "mpp": [
                *launcher(2),
                "pretrain/run.py",
                "--config",
                "mpp_demo",
                *TWO_STEPS,
            ],
            "mae": ["python", "pretrain/run.py", "--config", "mae_demo", *TWO_STEPS],
            "hpm": ["python", "pretrain/run.py", "--config", "hpm_demo", *TWO_STEPS],
            "finetune": [
                "python",
                "downstream/finetune.py",
                "--config",
                "finetune_demo",
                "--set",
                f"init={runs['mpp']}",
                *TWO_STEPS,
            ],
            "knn": [
                "python",
                "downstream/knn.py",
                "--config",
                "linear_demo",
                "--set",
                f"init={runs['mpp']}",
            ],
        }
        for kind, cmd in commands.items():
            r = run_cli([*cmd, "--output-dir", str(runs[kind])])
            assert r.returncode == 0, f"{kind}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
        yield runs


def ours(source) -> VisionTransformer:
    """Our encoder (or classifier) as ``source`` states it, with its weights, strictly."""
    sd, kwargs = load_pretrained(source)
    model = create_vit(**kwargs).eval()
    model.load_state_dict(sd)
    return model


def the_error(rc: int, stderr: str) -> str:
    """The one line a refusing tool prints (and its non-zero status)."""
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    assert rc != 0 and len(lines) == 1 and lines[0].startswith("error: "), (
        f"exit {rc}: {stderr[-3000:]}"
    )
    return lines[0]


def images(n: int = 2) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("objective", PRETRAIN)
def test_a_pretraining_run_exports_to_safetensors_timm_and_hf_with_its_features(
    demo_runs, objective, tmp_path
):
    run = demo_runs[objective]
    model, x = ours(run), images()
    for fmt in export.FORMATS:
        assert export.main([str(run), "--format", fmt, "--out", str(tmp_path / fmt)]) == 0
    exported = load_file(tmp_path / "safetensors")
    assert all(torch.equal(exported[k], v) for k, v in model.state_dict().items())

    hf = transformers.ViTModel.from_pretrained(tmp_path / "hf", add_pooling_layer=False).eval()
    config = json.loads((tmp_path / "timm" / "config.json").read_text())
    args = {k: v for k, v in config["model_args"].items() if k not in ("class_token", "fc_norm")}
    timm_like = VisionTransformer(
        **args
    ).eval()  # timm does not import here: its constructor arguments, our ViT
    timm_like.load_state_dict(load_file(tmp_path / "timm" / "model.safetensors"), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(
            hf(pixel_values=x).last_hidden_state, model.forward_features(x), rtol=0, atol=1e-5
        )
        assert torch.equal(timm_like.forward_features(x), model.forward_features(x))
    processor = json.loads((tmp_path / "hf" / "preprocessor_config.json").read_text())
    assert processor["size"] == {"height": 32, "width": 32} and config["pretrained_cfg"][
        "input_size"
    ] == [3, 32, 32]


def test_the_fine_tuned_run_exports_to_timm_with_its_logits_and_hf_refuses_its_mean_pooling(
    demo_runs, tmp_path, capsys
):
    run = demo_runs["finetune"]
    model, x = ours(run), images()
    for source in (
        run,
        run / "checkpoints",
    ):  # the run's config.json leaves the head to the weights
        folder = tmp_path / "timm" / source.name
        assert export.main([str(source), "--format", "timm", "--out", str(folder)]) == 0
        config = json.loads((folder / "config.json").read_text())
        assert config["model_args"]["global_pool"] == "avg" and config["label_names"] == [
            str(d) for d in range(10)
        ]
        args = {
            k: v for k, v in config["model_args"].items() if k not in ("class_token", "fc_norm")
        }
        timm_like = VisionTransformer(**args).eval()
        timm_like.load_state_dict(load_file(folder / "model.safetensors"), strict=True)
        with torch.no_grad():
            assert torch.equal(timm_like(x), model(x)) and model(x).shape == (2, 10)
    capsys.readouterr()
    rc = export.main([str(run), "--format", "hf", "--out", str(tmp_path / "hf")])
    assert (
        "global_pool='avg'" in the_error(rc, capsys.readouterr().err)
        and not (tmp_path / "hf").exists()
    )


def test_fine_tuning_starts_from_the_pretraining_runs_encoder(demo_runs):
    pre, ft = (
        load_file(demo_runs["mpp"] / "encoder.safetensors"),
        load_file(demo_runs["finetune"] / "encoder.safetensors"),
    )
    assert json.loads((demo_runs["finetune"] / "results.json").read_text())["init"] == str(
        demo_runs["mpp"]
    )
    shared = [k for k in pre if k.startswith(("blocks.", "patch_embed.", "cls_token", "pos_embed"))]
    # 2 warm-up steps move a weight by ~lr (< 1e-4); a fresh initialisation is ~0.02 away
    assert shared and all((ft[k] - pre[k]).abs().max() < 1e-3 for k in shared)
    assert not any(k.startswith("head.") for k in pre) and ft["head.weight"].shape == (10, 128)


def test_hpm_run_fine_tunes_with_a_token_head_into_a_transformers_classifier(demo_runs, tmp_path):
    """The fine-tune config's variant is patch 8 (the MPP demo's): with model.patch_size set to 8
    on purpose an HPM (patch 4) run is refused naming both (unset, it would be taken from the
    run: tests/test_downstream.py); then taken with the demo's own variant; a cls-token head
    exports to HF."""
    init = ["--set", f"init={demo_runs['hpm']}"]
    cmd = ["python", "downstream/finetune.py", "--config", "finetune_demo", *init, *TWO_STEPS]
    r = run_cli([*cmd, "--set", "model.patch_size=8", "--output-dir", str(tmp_path / "refused")])
    assert "patch_size 4, the model's 8" in the_error(r.returncode, r.stderr)
    out = tmp_path / "ft"
    r = run_cli(
        [
            *cmd,
            "--set",
            "model.name=vit_tiny_patch4_32",
            "--set",
            "finetune.global_pool=token",
            "--output-dir",
            str(out),
        ]
    )
    assert r.returncode == 0, r.stderr[-3000:]
    pre, ft = (
        load_file(demo_runs["hpm"] / "encoder.safetensors"),
        load_file(out / "encoder.safetensors"),
    )
    assert all((ft[k] - pre[k]).abs().max() < 1e-3 for k in pre)  # the student, with its final norm
    folder = export.export(out, "hf", tmp_path / "hf")
    hf = transformers.ViTForImageClassification.from_pretrained(folder).eval()
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(hf(pixel_values=x).logits, ours(out)(x), rtol=0, atol=1e-5)
    assert hf.config.id2label[7] == "7"


def test_probes_read_the_run_and_its_exports_alike(demo_runs, tmp_path):
    knn = json.loads((demo_runs["knn"] / "results.json").read_text())
    assert 0 <= knn["top1"] <= 100 and knn["num_train"] == 1497 and knn["num_val"] == 300
    # (the linear probe reads this run in test_probe_protocols_and_per_block_tables_on_the_demo_run)
    for fmt in ("timm", "hf"):  # the same weights from another folder: the same votes
        folder = export.export(demo_runs["mpp"], fmt, tmp_path / fmt)
        r = run_cli(
            [
                "python",
                "downstream/knn.py",
                "--config",
                "linear_demo",
                "--set",
                f"init={folder}",
                "--output-dir",
                str(tmp_path / f"knn_{fmt}"),
            ]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert (
            json.loads((tmp_path / f"knn_{fmt}" / "results.json").read_text())["top1"]
            == knn["top1"]
        )


def test_probe_protocols_and_per_block_tables_on_the_demo_run(demo_runs, tmp_path, capsys):
    """--protocol mae and dinov2, --layers all for the linear probe and k-NN, on the MPP demo
    run (4 blocks): each writes what its protocol promises; the per-block k-NN's last block is
    the plain k-NN run's vote (the hooks' features are forward_features')."""
    probe = [
        "--config",
        "linear_demo",
        "--set",
        f"init={demo_runs['mpp']}",
        "--set",
        "probe.epochs=2",
        "--set",
        "probe.warmup_epochs=1",
    ]
    commands = {
        "mae": ["linear_probe.py", "--protocol", "mae"],
        "dinov2": ["linear_probe.py", "--protocol", "dinov2"],
        "linear_all": ["linear_probe.py", "--layers", "all"],
        "knn_all": ["knn.py", "--layers", "all"],
    }
    res = {}
    for name, (tool, *flags) in commands.items():
        r = run_cli(
            ["python", f"downstream/{tool}", *probe, *flags, "--output-dir", str(tmp_path / name)]
        )
        assert r.returncode == 0, f"{name}: {r.stderr[-3000:]}"
        res[name] = json.loads((tmp_path / name / "results.json").read_text())
    mae = res[
        "mae"
    ]  # 1497 images, batch 256: 5 steps an epoch (the last partial batch dropped), lr 0.1 x 256 / 256
    assert (mae["protocol"], mae["steps_per_epoch"], mae["lr"], mae["num_val"]) == (
        "mae",
        5,
        0.1,
        300,
    )
    assert mae["max_top1"] >= mae["top1"] and "per_block" not in mae
    dino = res["dinov2"]
    assert len(dino["grid"]) == 52 and dino["num_holdout"] == 150 and dino["num_train"] == 1497
    best = max(dino["grid"], key=lambda g: g["holdout_top1"])
    assert dino["best"]["holdout_top1"] == best["holdout_top1"] and dino["top1"] == best["val_top1"]
    assert {(g["n_blocks"], g["avgpool"]) for g in dino["grid"]} == {
        (1, False),
        (1, True),
        (4, False),
        (4, True),
    }
    knn_last = json.loads((demo_runs["knn"] / "results.json").read_text())
    for name in ("linear_all", "knn_all"):
        rows = res[name]["per_block"]
        assert [r["block"] for r in rows] == [0, 1, 2, 3] and res[name]["top1"] == rows[-1]["top1"]
        table = (tmp_path / name / "results.md").read_text()
        assert all(f"| {r['block']} | {r['top1']:.2f} |" in table for r in rows)
        with Image.open(tmp_path / name / "per_block.png") as pic:
            assert pic.format == "PNG" and pic.width > 200
    assert res["knn_all"]["per_block"][-1]["top1"] == knn_last["top1"]
    # the refusal from the linear probe's main in this process (the CLIs' whole stderr is one line:
    # test_a_tool_that_cannot_serve_a_run_says_so_in_one_line)
    capsys.readouterr()
    refused = ["--protocol", "dinov2", "--layers", "all", "--output-dir", str(tmp_path / "refused")]
    rc = run_probe("linear", [*probe, *refused])
    assert "probe.layers: 'all' with probe.protocol 'dinov2'" in the_error(
        rc, capsys.readouterr().err
    )
    assert not (tmp_path / "refused").exists()


@pytest.mark.parametrize("objective", PRETRAIN)
def test_viz_draws_each_pretraining_run(demo_runs, objective, tmp_path):
    png = tmp_path / "x.png"
    assert (
        viz.main(["--checkpoint", str(demo_runs[objective]), "--out", str(png), "--images", "2"])
        == 0
    )
    panels = 4 if objective == "hpm" else 3  # HPM adds the teacher's predicted loss
    with Image.open(png) as pic:
        assert pic.format == "PNG" and pic.size == picture_size(2, 32, 32, 3, panels)


@pytest.mark.parametrize(
    "kind,stage", [("hpm", "pretrain/run.py"), ("finetune", "downstream/finetune.py")]
)
def test_resume_auto_continues_a_run_at_its_last_step(demo_runs, kind, stage, tmp_path):
    run = tmp_path / kind
    shutil.copytree(demo_runs[kind], run)
    config = json.loads((run / "config.json").read_text())["name"]
    r = run_cli(
        [
            "python",
            stage,
            "--config",
            config,
            "--set",
            "train.max_steps=4",
            "--output-dir",
            str(run),
            "--resume",
            "auto",
        ]
        + (["--set", f"init={demo_runs['mpp']}"] if kind == "finetune" else [])
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / 'step00000002'} at step 2" in r.stderr
    steps = [m for m in read_metrics(run) if "loss" in m]
    assert [m["step"] for m in steps] == [2, 4] and steps[-1]["samples"] == 4 * 64
    assert (run / "checkpoints" / "step00000004").is_dir()


def test_a_tool_that_cannot_serve_a_run_says_so_in_one_line(demo_runs, tmp_path, capsys):
    runs = demo_runs
    refusals = [
        (
            lambda: export.main([str(runs["knn"]), "--out", str(tmp_path / "e")]),
            "a knn evaluation run keeps no weights",
        ),
        (
            lambda: viz.main(
                ["--checkpoint", str(runs["finetune"]), "--out", str(tmp_path / "f.png")]
            ),
            "a fine-tuning run",
        ),
        (
            lambda: viz.main(["--checkpoint", str(runs["knn"]), "--out", str(tmp_path / "k.png")]),
            "probe run keeps no weights",
        ),
    ]
    for call, reason in refusals:
        capsys.readouterr()
        assert reason in the_error(call(), capsys.readouterr().err)
    knn = ["--config", "linear_demo", "--output-dir", str(tmp_path / "never")]
    # the CLI once (its whole stderr is the one line), then its main in this process
    r = run_cli(["python", "downstream/knn.py", *knn, "--set", f"init={runs['finetune']}"])
    assert "its weights pool global_pool='avg'" in the_error(r.returncode, r.stderr)
    for init, reason, sets in (
        (runs["knn"], "keeps no weights", []),
        # a patch size chosen on purpose that the run's weights do not have
        (runs["mae"], "patch_size 4, the model's 8", ["--set", "model.patch_size=8"]),
    ):
        capsys.readouterr()
        rc = run_probe("knn", [*knn, "--set", f"init={init}", *sets])
        assert reason in the_error(rc, capsys.readouterr().err)
    assert not (tmp_path / "never").exists() and not (tmp_path / "f.png").exists()
