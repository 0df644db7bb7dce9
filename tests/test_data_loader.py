"""Training and evaluation loaders (mpp/data/loader.py): exact passes, equal batch counts,
determinism and resume, bad data, shards from other tools and over HTTP.
"""

import functools
import http.server
import io
import itertools
import logging
import signal
import socket
import tarfile
import threading

import numpy as np
import pytest
import torch
from conftest import listed_samples, write_tar
from PIL import Image

from mpp.data import (
    WriterOptions,
    make_eval_loader,
    make_train_loader,
    write_shards,
)


def encode(seed: int, fmt: str = "JPEG", h: int = 24, w: int = 32) -> bytes:
    array = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, fmt)
    return buf.getvalue()


def make_shards(folder, counts: list[int], prefix: str = "s") -> tuple[list[str], dict[str, int]]:
    """One shard per count, labels = sample number % 5; returns the paths and {"url#key": label}."""
    paths, labels, n = [], {}, 0
    for i, count in enumerate(counts):
        sub = folder / f"{prefix}{i}"
        samples = [(encode(n + j), (n + j) % 5) for j in range(count)]
        path = write_shards(samples, sub, prefix, options=WriterOptions(seed=None, progress=False))[
            0
        ]
        labels.update({f"{path}#{j:09d}": (n + j) % 5 for j in range(count)})
        paths.append(path)
        n += count
    return paths, labels


def collect(loader) -> tuple[list[str], list[int], list[dict]]:
    batches = list(loader)
    keys = [k for b in batches for k in b["key"]]
    labels = [int(v) for b in batches for v in b.get("label", [])]
    return keys, labels, batches


def test_eval_pass_sees_every_sample_once_across_ranks_and_workers(tmp_path):
    paths, truth = make_shards(tmp_path, [3, 5, 1, 4, 2, 6, 3, 2])
    keys, labels = [], []
    for rank in range(2):
        loader = make_eval_loader(
            paths, batch_size=4, img_size=16, rank=rank, world_size=2, num_workers=2, with_keys=True
        )
        k, lab, batches = collect(loader)
        keys += k
        labels += lab
        assert all(
            b["image"].dtype == torch.uint8 and b["image"].shape[1:] == (3, 16, 16) for b in batches
        )
        assert all(b["label"].dtype == torch.int64 for b in batches)
    assert sorted(keys) == sorted(truth)  # every sample exactly once over 2 ranks x 2 workers
    assert labels == [truth[k] for k in keys]
    with pytest.raises(ValueError, match="need batch_size >= 1"):  # not a pass that yields nothing
        make_eval_loader(paths, batch_size=0, img_size=16)


@pytest.mark.parametrize("num_workers", [2, 0])
def test_every_rank_gets_the_same_number_of_batches(tmp_path, num_workers):
    paths, _ = make_shards(tmp_path, [1, 30, 2, 7])  # very unequal shards
    for rank in range(2):
        loader = make_train_loader(
            paths,
            batch_size=4,
            num_batches=7,
            img_size=16,
            rank=rank,
            world_size=2,
            num_workers=num_workers,
            with_labels=True,
            shuffle_buffer=8,
        )
        batches = list(loader)
        assert len(loader) == len(batches) == 7
        assert all(b["image"].shape == (4, 3, 16, 16) and b["label"].shape == (4,) for b in batches)


def test_seed_epoch_and_resume_determinism(tmp_path):
    paths, _ = make_shards(tmp_path, [6, 9, 5, 8])

    def run(num_workers=2, **kw):
        args = dict(
            batch_size=3,
            num_batches=7,
            img_size=16,
            seed=5,
            epoch=1,
            num_workers=num_workers,
            shuffle_buffer=10,
            with_keys=True,
        )
        return list(make_train_loader(paths, **(args | kw)))

    def same(a, b):
        return len(a) == len(b) and all(
            x["key"] == y["key"] and torch.equal(x["image"], y["image"])
            for x, y in zip(a, b, strict=True)
        )

    straight = run()
    assert same(straight, run(num_workers=0))  # workers build parts of a batch, not whole batches
    for k in (3, 6):
        assert same(straight[k:], run(start_batch=k))
    assert same(run(num_workers=0)[2:], run(num_workers=0, start_batch=2))
    assert not same(straight[:2], run(seed=6)[:2])
    assert not same(straight[:2], run(epoch=2)[:2])
    # a different crop/flip for the same sample: augmentation depends on the sample's position, not only its bytes
    images = [b["image"] for b in straight]
    assert len({tuple(img.flatten()[:64].tolist()) for batch in images for img in batch}) == 21


def test_a_step_trains_on_the_same_samples_whatever_the_world_size_batch_split_or_workers(tmp_path):
    """The global order (mpp.data.order): a step's samples (keys and augmented pixels) depend on
    (seed, epoch, step) only, so a run resumed on another world size continues the same epoch;
    within an epoch no sample comes twice; a resume point gives the rest of the steps."""
    paths, truth = make_shards(tmp_path, [6, 9, 5, 8, 3, 7])  # 38 samples, unequal shards
    B, T = 12, 38 // 12

    def steps(world, micro, workers, start_step=0, epoch=0):
        accum, out = B // (world * micro), {}
        for rank in range(world):
            loader = make_train_loader(
                paths,
                batch_size=micro,
                world_size=world,
                rank=rank,
                global_batch=B,
                num_batches=T * accum,
                start_batch=start_step * accum,
                img_size=16,
                num_workers=workers,
                with_keys=True,
                shuffle_buffer=4,
                epoch=epoch,
            )
            for i, batch in enumerate(loader):
                out.setdefault(start_step + i // accum, []).extend(
                    zip(batch["key"], batch["image"].sum((1, 2, 3)).tolist(), strict=True)
                )
        return {step: sorted(samples) for step, samples in out.items()}

    one = steps(1, 12, 0)
    keys = [k for samples in one.values() for k, _ in samples]
    assert len(keys) == len(set(keys)) == B * T and set(keys) <= set(truth)
    for world, micro, workers in [
        (2, 6, 2),
        (3, 4, 2),
        (3, 2, 1),
        (4, 1, 2),
    ]:  # accumulation 1, 1, 2, 3
        assert steps(world, micro, workers) == one
    assert steps(3, 2, 2, start_step=1) == {s: v for s, v in one.items() if s >= 1}
    assert steps(1, 12, 0, epoch=1) != one


def test_persistent_workers_give_every_epoch_and_resume_point_of_a_fresh_loader(tmp_path):
    """One loader whose workers live across epochs (set_epoch) yields, batch for batch, what a new
    loader per epoch yields, from the start or from a resume point; the worker processes stay."""
    paths, _ = make_shards(tmp_path, [5, 7, 4, 6])
    kw = dict(
        batch_size=3,
        num_batches=6,
        img_size=16,
        seed=5,
        num_workers=2,
        shuffle_buffer=10,
        with_keys=True,
    )

    def keys_and_pixels(loader):
        return [(b["key"], b["image"]) for b in loader]

    kept = make_train_loader(paths, persistent=True, **kw)
    pids = set()
    for epoch, start in ((0, 0), (1, 0), (1, 3), (2, 1)):
        kept.set_epoch(epoch, start)
        assert len(kept) == 6 - start
        got = keys_and_pixels(kept)
        fresh = keys_and_pixels(make_train_loader(paths, epoch=epoch, start_batch=start, **kw))
        assert [k for k, _ in got] == [k for k, _ in fresh]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, fresh, strict=True))
        pids.add(tuple(w.pid for w in kept._loader._iterator._workers))
    assert len(pids) == 1  # the same two worker processes served every epoch
    # onwards: one pass from epoch 1's batch 3 into epochs 2 and 3 (their streams primed during
    # the last batches before them): the same batches as a pass per epoch, with accumulation
    accum = dict(kw, batch_size=1, global_batch=3)
    kept = make_train_loader(paths, persistent=True, **accum)
    kept.set_epoch(1, 3, onwards=True)
    got = keys_and_pixels(itertools.islice(kept, 3 + 6 + 6))
    fresh = []
    for epoch, start in ((1, 3), (2, 0), (3, 0)):
        fresh += keys_and_pixels(make_train_loader(paths, epoch=epoch, start_batch=start, **accum))
    assert [k for k, _ in got] == [k for k, _ in fresh]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, fresh, strict=True))
    kept.set_epoch(0, 0)  # a pass left mid-way: the next one starts where it is told
    assert [k for k, _ in keys_and_pixels(kept)] == [
        k for k, _ in keys_and_pixels(make_train_loader(paths, **accum))
    ]
    kept.close()


def test_bad_data_is_skipped_and_counted_exactly(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="mpp.data")
    good, _ = make_shards(tmp_path, [4, 3])
    jpeg = encode(99)
    mixed = write_tar(
        tmp_path / "mixed.tar",
        [
            ("a.jpg", encode(1)),
            ("a.cls", b"1"),
            ("b.jpg", b"garbage, not an image"),
            ("b.cls", b"2"),  # 1: undecodable
            ("c.jpg", jpeg[: len(jpeg) // 2]),
            ("c.cls", b"3"),  # 2: truncated JPEG
            ("d.cls", b"4"),  # 3: no image member
            ("e.png", encode(2, "PNG")),
            ("e.cls", b"0"),
        ],
    )
    cut = write_tar(
        tmp_path / "cut.tar",
        [
            (f"{i}.{ext}", encode(i) if ext == "jpg" else b"1")
            for i in range(4)
            for ext in ("jpg", "cls")
        ],
    )
    with tarfile.open(cut) as tar:
        member = tar.getmember("2.jpg")
    data = open(cut, "rb").read()
    open(cut, "wb").write(
        data[: member.offset_data + member.size // 2]
    )  # 4: truncated tar, cut inside sample 2
    shards = good + [mixed, cut]
    loader = make_eval_loader(shards, batch_size=5, img_size=16, num_workers=2, with_keys=True)
    keys, _, batches = collect(loader)
    assert len(keys) == 4 + 3 + 2 + 2  # good, good, mixed (a, e), cut (0, 1)
    assert loader.skipped == 4  # summed over both worker processes
    # named by this process, each once, with the running count
    assert "mixed.tar#d: no image member" in caplog.text and "[4 skipped so far]" in caplog.text

    caplog.clear()
    train = make_train_loader(
        [mixed, cut], batch_size=4, num_batches=5, img_size=16, num_workers=0, with_labels=True
    )
    batches = list(train)
    assert len(batches) == 5 and batches[-1]["skipped"] == train.skipped > 0
    assert [b["skipped"] for b in batches] == sorted(b["skipped"] for b in batches)
    assert "cut.tar" in caplog.text
    assert (
        "mixed.tar#d" not in caplog.text
    )  # no image: outside the training order (the census names it)
    assert len(caplog.records) < train.skipped  # each named once, however often it is met


def test_a_bad_sample_is_named_once_per_run_and_counted_in_each_epoch_that_meets_it(
    tmp_path, caplog
):
    """Issue 50, finding 5: over 3 epochs of one ``onwards`` pass (a training run's), the damaged
    JPEG is named once, by the training process, with the running count; each epoch counts it
    once, in its own batches: the next epoch's streams are opened early (primed) during this
    one's last batches, but a run resumed at the next epoch counts it there, so counting it
    early would count it twice across a resume."""
    caplog.set_level(logging.WARNING, logger="mpp.data")
    jpeg = encode(99)
    damaged = jpeg[: jpeg.index(b"\xff\xda") + 14] + b"\x00\x01" * 200 + b"\xff\xd8\xff\xd9"

    def shard(name: str) -> str:  # 12 samples; shard "b" starts with the damaged one
        members = []
        for i in range(12):
            image = damaged if (name, i) == ("b", 0) else encode(12 * (name == "b") + i)
            members += [(f"{name}{i:02d}.jpg", image), (f"{name}{i:02d}.cls", b"1")]
        return write_tar(tmp_path / f"{name}.tar", members)

    shards = [shard("a"), shard("b")]
    # 24 samples, 4 streams of 6: every sample read once an epoch; the damaged one, at a shard's
    # start, is a stream's first sample (no shuffle window), the one the priming reads
    settings = dict(batch_size=4, num_batches=6, img_size=16, shuffle_buffer=1, num_workers=2)
    loader = make_train_loader(shards, persistent=True, **settings)
    loader.set_epoch(0, onwards=True)
    counts = [b["skipped"] for b in itertools.islice(loader, 18)]
    loader.close()
    named = [r.getMessage() for r in caplog.records if "b.tar#b00" in r.getMessage()]
    assert len(named) == 1 and named[0].endswith("[1 skipped so far]"), caplog.text
    per_epoch = [counts[5], counts[11] - counts[5], counts[17] - counts[11]]
    assert per_epoch == [1, 1, 1]
    for epoch in range(3):  # what a run resumed at each epoch's start counts for it
        fresh = make_train_loader(shards, epoch=epoch, **settings)
        assert list(fresh)[-1]["skipped"] == 1


def test_all_bad_shards_raise_instead_of_looping(tmp_path):
    not_tars = [write_tar(tmp_path / f"e{i}.tar", []) for i in range(2)] + [
        str(tmp_path / "jpeg.tar")
    ]
    (tmp_path / "jpeg.tar").write_bytes(encode(0))
    with pytest.raises(RuntimeError, match="consecutive.*jpeg.tar|consecutive.*e0.tar"):
        list(
            make_train_loader(
                not_tars,
                batch_size=2,
                num_batches=2,
                img_size=16,
                num_workers=0,
                max_consecutive_errors=5,
            )
        )
    corrupt = write_tar(
        tmp_path / "corrupt.tar", [(f"{i}.jpg", b"\xff\xd8\xff junk") for i in range(4)]
    )
    with pytest.raises(RuntimeError, match="consecutive"):
        list(
            make_train_loader(
                [corrupt],
                batch_size=2,
                num_batches=2,
                img_size=16,
                num_workers=0,
                max_consecutive_errors=5,
            )
        )


def test_start_checks_name_the_problem(tmp_path):
    paths, _ = make_shards(tmp_path, [2, 2, 2])
    # streams, not shards, are dealt to ranks and workers: 3 shards feed 2 ranks x 2 workers
    few = make_train_loader(
        paths, batch_size=2, num_batches=1, img_size=16, rank=1, world_size=2, num_workers=2
    )
    assert len(list(few)) == 1
    with pytest.raises(ValueError, match="global_batch 6 is not batch_size 2 x world_size 2"):
        make_train_loader(
            paths, batch_size=2, num_batches=1, img_size=16, world_size=2, global_batch=6
        )
    # an evaluation pass lets a worker (or a rank) go without a shard: rank 2 of 4 on 3 shards reads one
    assert (
        sum(
            len(b["label"])
            for b in make_eval_loader(paths, batch_size=2, img_size=16, rank=2, world_size=4)
        )
        == 2
    )
    assert list(make_eval_loader(paths, batch_size=2, img_size=16, rank=3, world_size=4)) == []
    with pytest.raises(ValueError, match="allow_pipe"):
        make_eval_loader([f"pipe:cat {paths[0]}"], batch_size=2, img_size=16, num_workers=0)
    piped = make_eval_loader(
        [f"pipe:cat {paths[0]}"], batch_size=2, img_size=16, num_workers=0, allow_pipe=True
    )
    assert sum(len(b["image"]) for b in piped) == 2
    with pytest.raises(FileNotFoundError, match="nowhere-000001.tar"):
        make_train_loader(
            paths + [str(tmp_path / "nowhere-000001.tar")],
            batch_size=2,
            num_batches=1,
            img_size=16,
            num_workers=0,
        )


def test_shards_from_other_tools_with_num_samples(tmp_path):
    """img2dataset layout: jpg/png/webp + cls + json/txt members, no sizes.json."""
    exts = ["jpg", "png", "webp"]
    for s in range(3):
        members = []
        for i in range(3 * s, 3 * s + 3):
            fmt = exts[i % 3]
            members += [
                (f"{i:09d}.{fmt}", encode(i, "JPEG" if fmt == "jpg" else fmt.upper())),
                (f"{i:09d}.cls", str(i).encode()),
                (f"{i:09d}.json", b"{}"),
                (f"{i:09d}.txt", b"a caption"),
            ]
        write_tar(tmp_path / f"{s:05d}.tar", members)
    spec = str(tmp_path / "{00000..00002}.tar")
    num_samples = 9  # given by the caller
    loader = make_train_loader(
        spec,
        batch_size=3,
        num_batches=num_samples // 3,
        img_size=16,
        num_workers=0,
        with_labels=True,
        num_classes=10,
    )
    assert len(list(loader)) == 3 and loader.skipped == 0
    _, labels, _ = collect(
        make_eval_loader(
            spec, batch_size=4, img_size=16, num_workers=0, num_classes=10, with_keys=True
        )
    )
    assert sorted(labels) == list(range(9))


@pytest.fixture
def data_http_server(tmp_path):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_http_shards_and_unreachable_url(tmp_path, data_http_server, caplog):
    write_shards(
        [(encode(i), i) for i in range(6)],
        tmp_path,
        "web",
        options=WriterOptions(max_count=3, progress=False),
    )
    spec = f"{data_http_server}/web-{{000000..000001}}.tar"
    assert listed_samples(spec) == 6  # sizes.json fetched over HTTP
    dead = f"http://127.0.0.1:{closed_port()}/web-000000.tar"
    caplog.set_level(logging.WARNING, logger="mpp.data")
    loader = make_eval_loader([spec, dead], batch_size=4, img_size=16, num_workers=0)
    assert sorted(int(v) for b in loader for v in b["label"]) == list(range(6))
    assert loader.skipped == 1 and dead in caplog.text
    with pytest.raises(RuntimeError, match=dead):
        list(
            make_train_loader(
                [dead],
                batch_size=2,
                num_batches=1,
                img_size=16,
                num_workers=0,
                max_consecutive_errors=3,
            )
        )


def _sleep_forever():
    import time

    time.sleep(600)


def test_the_exit_hook_kills_our_workers_only(tmp_path):
    """At exit the loader kills the workers it started (they ignore SIGTERM, and multiprocessing's
    own hook would wait on them); it killed every daemon child of the process, others' included."""
    import multiprocessing

    from mpp.data import loader as loader_module

    paths, _ = make_shards(tmp_path, [5, 7])
    kept = make_train_loader(
        paths, persistent=True, batch_size=3, num_batches=2, img_size=16, num_workers=2
    )
    next(iter(kept))
    ours = list(kept._loader._iterator._workers)
    theirs = multiprocessing.get_context("fork").Process(target=_sleep_forever, daemon=True)
    theirs.start()
    sigchld = signal.getsignal(
        signal.SIGCHLD
    )  # the hook resets DataLoader's handler: put it back after
    try:
        assert {w.pid for w in ours} <= {w.pid for w in loader_module._WORKERS}
        loader_module._kill_workers_at_exit()
        for w in ours:
            w.join(10)
        assert not any(w.is_alive() for w in ours) and theirs.is_alive()
    finally:
        signal.signal(signal.SIGCHLD, sigchld)
        theirs.kill()
        kept._loader = None  # its workers are gone: nothing for close() to shut down
