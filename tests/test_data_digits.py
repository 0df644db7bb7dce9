"""The built-in digits dataset (mpp/data/digits.py)."""

import threading

import pytest
import torch
from conftest import listed_samples

from mpp.data import digits as digits_module
from mpp.data import digits_shards, expand_shards, make_eval_loader, read_sizes


def test_digits_shards_build_once_with_the_right_counts(tmp_path, monkeypatch):
    info = digits_shards(img_size=16, cache_dir=tmp_path)
    assert (info["num_train"], info["num_val"], info["num_classes"]) == (1497, 300, 10)
    assert len(expand_shards(info["train"])) == 8 and len(expand_shards(info["val"])) == 4
    assert listed_samples(info["train"]) == 1497 and listed_samples(info["val"]) == 300
    assert read_sizes(info["val"])["class_names"] == [str(d) for d in range(10)]

    loader = make_eval_loader(
        info["val"], batch_size=100, img_size=16, num_workers=0, with_keys=True
    )
    batches = list(loader)
    labels = torch.cat([b["label"] for b in batches])
    assert len(labels) == 300 and set(labels.tolist()) == set(range(10))
    images = torch.cat([b["image"] for b in batches])
    assert images.shape == (300, 3, 16, 16)
    assert torch.equal(images[:, 0], images[:, 1]) and images.float().std() > 30  # grey, not blank

    def fail(*args, **kwargs):
        raise AssertionError("the cache should have been reused")

    monkeypatch.setattr(digits_module, "_build", fail)
    assert digits_shards(img_size=16, cache_dir=tmp_path) == info
    monkeypatch.setenv("MPP_CACHE", str(tmp_path))
    assert digits_shards(img_size=16) == info  # the env var names the same cache root
    assert [p.name for p in tmp_path.iterdir()] == ["digits-16"]  # no temp folders left behind


def test_digits_concurrent_builders_agree(tmp_path):
    results, errors = [], []

    def build():
        try:
            results.append(digits_shards(img_size=8, cache_dir=tmp_path, resample="nearest"))
        except Exception as exn:  # pragma: no cover - reported below
            errors.append(exn)

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and results[0] == results[1]
    assert listed_samples(results[0]["train"]) == 1497
    assert [p.name for p in tmp_path.iterdir()] == ["digits-8-nearest"]
    with pytest.raises(ValueError, match="resample"):
        digits_shards(img_size=8, cache_dir=tmp_path, resample="area")
