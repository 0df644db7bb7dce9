"""Few labels (mpp/data/labels.py): a balanced, seeded labelled subset of the training shards,
its key file, and the streams that read only it. The launcher runs on it are in
tests/test_few_labels.py."""

from __future__ import annotations

import collections
import itertools
import json

import numpy as np
import pytest

from mpp.data import StreamConfig, WriterOptions, make_eval_loader, make_train_loader, write_shards
from mpp.data.labels import choose, from_key_file, label_index, shard_labels


def shards(tmp_path, sizes=(30, 7, 23), label=lambda i: i % 5):
    """Unequal shards, 16-px images, labels ``label(i)``; the last shard's labels all 4 ... and a
    sample without a .cls in the first."""
    rng = np.random.default_rng(0)
    paths, start = [], 0
    for k, n in enumerate(sizes):
        samples = [
            (rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), label(start + i)) for i in range(n)
        ]
        if k == 0:
            samples.append((rng.integers(0, 256, (16, 16, 3), dtype=np.uint8), None))
        paths += write_shards(
            samples, tmp_path, f"s{k}", options=WriterOptions(max_count=n + 1, progress=False)
        )
        start += n
    return paths


def test_the_subset_is_balanced_seeded_and_names_a_short_class(tmp_path):
    paths = shards(tmp_path, label=lambda i: 4 if i >= 50 else i % 4)
    index = label_index(paths)
    assert index.total == 60  # the sample without a label is not in it
    subset, short = choose(index, per_class=6, seed=0)
    assert subset.per_class == {0: 6, 1: 6, 2: 6, 3: 6, 4: 6} and subset.total == 30
    assert short == []
    again, _ = choose(label_index(list(reversed(paths))), per_class=6, seed=0)
    assert sorted(again.lines()) == sorted(subset.lines())  # the shards' order does not matter
    other, _ = choose(index, per_class=6, seed=1)
    assert sorted(other.lines()) != sorted(subset.lines())
    big, short = choose(index, per_class=12, seed=0)
    assert short == ["class 4 has 10 labelled samples, fewer than 12"]
    assert big.per_class[4] == 10
    # a fraction is K = round(p N / C) per class
    frac, _ = choose(index, fraction=0.25, seed=0)
    assert frac.per_class == {c: 3 for c in range(5)}


def test_the_key_file_round_trips_and_an_unknown_key_is_named_with_the_file(tmp_path):
    paths = shards(tmp_path)
    index = label_index(paths)
    subset, _ = choose(index, per_class=3, seed=0)
    path = tmp_path / "keys.txt"
    subset.write(path)
    # the writer numbers each prefix from 0: a key another shard holds too carries its shard
    lines = path.read_text().splitlines()
    assert all(("#" in line) == (int(line.split("#")[-1]) <= 22) for line in lines)
    back = from_key_file(index, path)
    assert back.keys == subset.keys and back.shards == subset.shards
    (tmp_path / "bad.txt").write_text("# a comment\n\n" + path.read_text() + "s9-000000.tar#1\n")
    with pytest.raises(KeyError, match=r"bad.txt:18: key 's9-000000.tar#1' is not a labelled"):
        from_key_file(index, tmp_path / "bad.txt")
    # a bare key names every sample with it; one with an image extension is read as its key
    (tmp_path / "bare.txt").write_text("000000001.png\n")
    assert from_key_file(index, tmp_path / "bare.txt").total == 3


def test_the_streams_read_exactly_the_subset(tmp_path):
    paths = shards(tmp_path)
    subset, _ = choose(label_index(paths), per_class=4, seed=0)  # 20 samples
    wanted = {
        f"{url}#{key}" for url, keys in zip(subset.shards, subset.keys, strict=True) for key in keys
    }
    evals = make_eval_loader(
        subset.shards,
        shard_keys=subset.keys,
        batch_size=7,
        img_size=16,
        num_workers=0,
        with_keys=True,
    )
    seen = [k for batch in evals for k in batch["key"]]
    assert sorted(seen) == sorted(wanted)
    stream = StreamConfig(
        batch_size=4, img_size=16, num_batches=5, with_labels=True, shard_keys=subset.keys
    )
    trained = collections.Counter()
    for epoch in (0, 1):
        loader = make_train_loader(subset.shards, stream, epoch=epoch, num_workers=1)
        keys = make_train_loader(
            subset.shards, stream, epoch=epoch, num_workers=0, key_log=tmp_path / f"k{epoch}"
        )
        assert len(loader) == 5 and sum(len(b["image"]) for b in loader) == 20
        list(keys)
        epoch_keys = [
            k
            for line in (tmp_path / f"k{epoch}").read_text().splitlines()
            for k in json.loads(line)["keys"]
        ]
        assert sorted(epoch_keys) == sorted(wanted)  # every sample of the subset once an epoch
        trained.update(epoch_keys)
    # a resume inside a shard skips the subset's samples, not the shard's
    rest = make_train_loader(
        subset.shards, stream, epoch=1, start_batch=2, num_workers=0, key_log=tmp_path / "r"
    )
    list(rest)
    resumed = [
        k for line in (tmp_path / "r").read_text().splitlines() for k in json.loads(line)["keys"]
    ]
    straight = [
        k
        for line in (tmp_path / "k1").read_text().splitlines()[2:]
        for k in json.loads(line)["keys"]
    ]
    assert resumed == straight


def test_a_shard_cut_short_keeps_the_labels_before_the_cut(tmp_path):
    (path,) = shards(tmp_path, sizes=(12,))[:1]
    data = open(path, "rb").read()
    cut = tmp_path / "cut.tar"
    cut.write_bytes(data[: len(data) // 2])
    whole, part = shard_labels(path), shard_labels(str(cut))
    assert 0 < len(part) < len(whole) and part == whole[: len(part)]


def test_a_small_subset_is_read_from_its_shards_once(tmp_path, monkeypatch):
    """A few-label epoch is a step or two: the subset's samples are kept after the first clean
    read (the same samples, in the same order, a resume's skip counted in the subset), so later
    epochs open no shard; a shard rewritten since is read again."""
    import mpp.data.order as order
    from mpp.data.errors import SkipCounter

    paths = shards(tmp_path)
    subset, _ = choose(label_index(paths), per_class=4, seed=0)
    epoch = order.EpochShards(
        subset.shards, [len(k) for k in subset.keys], [0, 1, 2], False, subset.keys
    )
    opened = []
    real = order.shard_samples
    monkeypatch.setattr(
        order, "shard_samples", lambda src, *a, **k: real(opened.extend(src) or src, *a, **k)
    )

    def read(start: int) -> list[str]:
        return [s["__key__"] for s in itertools.islice(epoch.read_from(start, SkipCounter()), 20)]

    first = read(0)
    assert len(opened) == 3 and sorted(first) == sorted(k for ks in subset.keys for k in ks)
    assert read(0) == first and read(5) == first[5:] + first[:5] and len(opened) == 3
    write_shards(  # the first shard rewritten: its file is read again
        [(np.zeros((16, 16, 3), np.uint8), 0)] * 31,
        tmp_path,
        "s0",
        options=WriterOptions(max_count=31, progress=False, overwrite=True),
    )
    read(0)
    assert len(opened) == 4
