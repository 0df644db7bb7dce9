"""Few labels through the real commands (issue 30 §1): fine-tuning on 3 ranks and the probes on one
read the same balanced subset, which RUN/label_keys.txt names and any of them can reuse; the
epoch is the subset; the validation split stays whole; top-1 is the last evaluation's."""

from __future__ import annotations

import json

from conftest import launcher, read_metrics, run_cli, tiny_config, write_config

from mpp.data import expand_shards
from mpp.data.labels import choose, label_index

K = 4


def test_three_ranks_fine_tune_on_the_subset_and_the_probes_reuse_its_key_file(tmp_path, digits16):
    raw = tiny_config(
        digits16,
        train={"batch_size": 12, "max_steps": 9, "ckpt_every": 100},
        data={"labels_per_class": K, "label_seed": 3, "log_keys": True, "shuffle_buffer": 4},
    )
    raw.pop("objective"), raw.pop("masking")
    raw["data"]["val_shards"] = digits16["val"]
    raw["finetune"] = {"mixup": 0.0, "cutmix": 0.0, "randaug_n": 0, "reprob": 0.0}
    raw["finetune"]["eval_every"] = 4
    out = tmp_path / "ft"
    head = launcher(3)
    cmd = ["downstream/finetune.py", "--config", str(write_config(tmp_path / "ft.json", raw))]
    r = run_cli([*head, *cmd, "--output-dir", str(out)])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]

    # the subset is the one chosen in this process: the same whatever the world size
    expected, _ = choose(label_index(expand_shards(digits16["train"])), K, seed=3)
    keys = (out / "label_keys.txt").read_text().splitlines()
    assert keys == expected.lines() and len(keys) == 10 * K
    # every epoch (40 samples, 3 steps of 12) trains the subset's samples only, none twice
    trained: dict[int, list[str]] = {}
    for path in (out / "keys").glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            trained.setdefault(rec["epoch"], []).extend(rec["keys"])
    chosen = {f"{s}#{k}" for s, ks in zip(expected.shards, expected.keys, strict=True) for k in ks}
    assert sorted(trained) == [0, 1, 2]
    for epoch_keys in trained.values():
        assert len(epoch_keys) == 36 == len(set(epoch_keys)) and set(epoch_keys) <= chosen
    # evaluated every 4 steps and after the last, on every validation image; top-1 the last's
    evals = [m for m in read_metrics(out) if "val_top1" in m]
    assert [m["step"] for m in evals] == [4, 8, 9]
    res = json.loads((out / "results.json").read_text())
    assert res["num_train"] == 10 * K and res["last"]["num_val"] == 300
    assert res["top1"] == evals[-1]["val_top1"] and res["max_top1"] >= res["top1"]
    assert res["max_top1"] == max(m["val_top1"] for m in evals)

    # the probes: K per class with the same seed, or the run's key file: the same subset
    probe = {"name": "p", "init": "scratch", "model": raw["model"], "seed": 0}
    probe["data"] = {
        "train_shards": digits16["train"],
        "val_shards": digits16["val"],
        "num_workers": 1,
    }
    results = {}
    for name, setting in (
        ("per_class", [f"data.labels_per_class={K}", "data.label_seed=3"]),
        ("key_file", [f"data.label_keys={out / 'label_keys.txt'}"]),
    ):
        d = tmp_path / name
        sets = [a for s in setting for a in ("--set", s)]
        path = write_config(tmp_path / f"{name}.json", probe)
        r = run_cli(
            ["python", "downstream/knn.py", "--config", str(path), *sets, "--output-dir", str(d)]
        )
        assert r.returncode == 0, r.stderr[-3000:]
        assert (d / "label_keys.txt").read_text() == (out / "label_keys.txt").read_text()
        results[name] = json.loads((d / "results.json").read_text())
    assert results["per_class"]["num_train"] == 10 * K and results["per_class"]["num_val"] == 300
    assert results["per_class"]["top1"] == results["key_file"]["top1"]


def test_a_bad_subset_setting_exits_2_naming_the_key_and_the_file_before_any_run(
    tmp_path, digits16, capfd
):
    from mpp.commands.knn import main as knn_main
    from mpp.commands.pretrain import main as pretrain_main

    probe = {"name": "p", "init": "scratch", "output_dir": str(tmp_path / "out")}
    probe["model"] = {"name": "vit_tiny_patch4_16", "depth": 1, "embed_dim": 32, "num_heads": 2}
    probe["data"] = {"train_shards": digits16["train"], "val_shards": digits16["val"]}
    path = write_config(tmp_path / "p.json", probe)
    (tmp_path / "keys.txt").write_text("000000004\nno-such-key\n")
    cases = {
        f"data.label_keys={tmp_path / 'keys.txt'}": f"data.label_keys: {tmp_path / 'keys.txt'}:2: "
        "key 'no-such-key' is not a labelled sample of the training shards",
        f"data.label_keys={tmp_path / 'none.txt'}": "data.label_keys: cannot read",
        "data.label_fraction=1.5": "data.label_fraction: Input should be less than or equal to 1",
    }
    capfd.readouterr()  # what the imports above printed (DeepSpeed's accelerator line)
    for i, (setting, message) in enumerate(cases.items()):
        argv = ["--config", str(path), "--set", setting]
        if i == 0:  # the process's whole stderr: the one line
            r = run_cli(["python", "downstream/knn.py", *argv])
            code, err = r.returncode, r.stderr
        else:  # the rest through the command's main, in this process
            code, err = knn_main(argv), capfd.readouterr().err
        assert code == 2 and message in err, err[-2000:]
        assert str(path) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()
    code = pretrain_main(["--config", "mpp_demo", "--set", "data.labels_per_class=3"])
    err = capfd.readouterr().err
    assert code == 2 and "data.labels_per_class: a labelled subset is for fine-tuning" in err
