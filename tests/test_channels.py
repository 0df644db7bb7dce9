"""Users' own images (issue 31 §1-3): any channel count, 16-bit and float arrays, statistics from
the data. Files written by the tools users write them with (tifffile, numpy, PIL); the launcher
runs over them are in tests/test_channels_runs.py."""

from __future__ import annotations

import io
import json
import random

import numpy as np
import pytest
import tifffile
import torch
import torch.nn.functional as F
from PIL import Image

from mpp.data import WriterOptions, write_shards
from mpp.data.stats import measure, pixel_stats
from mpp.data.transforms import (
    Augmentation,
    PixelFormat,
    SampleFormatError,
    collate,
    decode,
    eval_transform,
    random_resized_crop_box,
    resize_channels,
    train_transform,
)
from mpp.hub.pretrained import adapt_input_channels
from mpp.models.vit import create_vit
from mpp.objectives import create_objective
from mpp.objectives.mpp import color_classes, mean_color_targets
from mpp.ops import normalize, unnormalize
from mpp.train.panels import display


def tiff(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    tifffile.imwrite(out, array)
    return out.getvalue()


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def png16(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    Image.fromarray(array.astype(np.uint16)).save(out, format="PNG")  # PIL's mode I;16
    return out.getvalue()


RNG = np.random.default_rng(0)
BANDS = RNG.integers(0, 65536, (4, 20, 24), dtype=np.uint16)  # C x H x W, as tifffile writes bands


def test_every_writer_decodes_to_hwc_in_0_1_through_the_stated_range():
    fmt = PixelFormat(4, value_range=(0, 65535))
    want = BANDS.transpose(1, 2, 0).astype(np.float32) / 65535
    for data in (tiff(BANDS), tiff(BANDS.transpose(1, 2, 0)), npy(BANDS), npy(want * 65535)):
        got = decode(data, fmt)
        assert got.dtype == np.float32 and got.shape == (20, 24, 4)
        np.testing.assert_allclose(got, want, atol=1e-6)
    grey = RNG.integers(0, 65536, (20, 24), dtype=np.uint16)
    got = decode(png16(grey), PixelFormat(1, value_range=(0, 65535)))
    np.testing.assert_allclose(got[:, :, 0], grey / 65535, atol=1e-6)
    # 8-bit arrays stay uint8, whatever the channel count
    eight = RNG.integers(0, 256, (20, 24, 5), dtype=np.uint8)
    assert np.array_equal(decode(npy(eight), PixelFormat(5)), eight)


def test_a_sample_that_does_not_fit_says_what_it_holds():
    with pytest.raises(SampleFormatError, match=r"holds a 4x20x24 uint16 array, not 3 channel"):
        decode(tiff(BANDS), PixelFormat(3, value_range=(0, 65535)))
    with pytest.raises(SampleFormatError, match="data.value_range must say what"):
        decode(tiff(BANDS), PixelFormat(4))
    cube = RNG.random((4, 7, 4)).astype(np.float32)
    with pytest.raises(SampleFormatError, match="set data.layout"):
        decode(npy(cube), PixelFormat(4, value_range=(0, 1)))
    assert decode(npy(cube), PixelFormat(4, "CHW", (0, 1))).shape == (7, 4, 4)
    # an RGB JPEG in a 1-channel dataset is not silently made grey
    rgb = io.BytesIO()
    Image.fromarray(RNG.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(rgb, format="JPEG")
    with pytest.raises(SampleFormatError, match="not 1 channel"):
        decode(rgb.getvalue(), PixelFormat(1))


def test_arrays_are_cropped_with_the_rgb_paths_boxes_a_channel_at_a_time():
    # a smooth picture: PIL's 8-bit resampling rounds between its two passes and clips
    # overshoot, so on noise the two paths part by a few levels; on a photograph by about one
    coarse = RNG.integers(0, 256, (4, 5, 3), dtype=np.uint8)
    rgb = np.asarray(Image.fromarray(coarse).resize((40, 30), Image.BILINEAR))
    png = io.BytesIO()
    Image.fromarray(rgb).save(png, format="PNG")
    as_float = npy(rgb.astype(np.float32) / 255)
    fmt = PixelFormat(3, value_range=(0, 1))
    # the same box (the RNG draws the same), bicubic in float vs PIL's uint8: within a level
    a = train_transform(png.getvalue(), 16, random.Random(5), Augmentation(hflip=0.5))
    b = train_transform(as_float, 16, random.Random(5), Augmentation(hflip=0.5), fmt=fmt)
    assert b.dtype == np.float32 and np.abs(a / 255 - b).max() <= 1.5 / 255
    a, b = eval_transform(png.getvalue(), 16), eval_transform(as_float, 16, fmt=fmt)
    assert np.abs(a / 255 - b).max() <= 1.5 / 255
    box = random_resized_crop_box(40, 30, random.Random(1))
    planes = resize_channels(rgb.astype(np.float32) / 255, box, 12)
    ref = Image.fromarray(rgb[:, :, 1].astype(np.float32) / 255, "F").resize(
        (12, 12), Image.BICUBIC, box=box
    )
    np.testing.assert_array_equal(planes[:, :, 1], np.clip(np.asarray(ref), 0, 1))


def test_a_float_batch_normalises_as_its_8_bit_twin():
    eight = RNG.integers(0, 256, (4, 4, 2), dtype=np.uint8)
    batch8 = collate([(eight, 1, "a")])["image"]
    batchf = collate([(eight.astype(np.float32) / 255, 1, "a")])["image"]
    mixed = collate([(eight, 1, "a"), (eight.astype(np.float32) / 255, 2, "b")])["image"]
    assert batch8.dtype == torch.uint8 and batchf.dtype == mixed.dtype == torch.float32
    mean, std = (0.2, 0.6), (0.3, 0.1)
    torch.testing.assert_close(normalize(batchf, mean, std), normalize(batch8, mean, std))
    torch.testing.assert_close(mixed[0], mixed[1])


def test_mpp_keeps_rgbs_joint_colour_and_factorises_other_channel_counts():
    raw = torch.rand(2, 3, 8, 8)
    means = F.avg_pool2d(raw, 4).flatten(2).transpose(1, 2)  # (B, N, 3)
    assert torch.equal(mean_color_targets(raw, 4), color_classes(means, 3))  # the paper's 512
    four = torch.rand(2, 4, 8, 8)
    means = F.avg_pool2d(four, 4).flatten(2).transpose(1, 2)  # (B, N, 4)
    want = (means * 8).floor().clamp(0, 7).long()
    assert torch.equal(mean_color_targets(four, 4), want)  # one 3-bit class per channel
    encoder = create_vit("vit_tiny_patch4_16", depth=1, embed_dim=32, num_heads=2, in_chans=4)
    mpp = create_objective("mpp", encoder, mean=(0.5,) * 4, std=(0.25,) * 4)
    assert mpp.head.out_features == 4 * 8 and mpp.num_classes == 8
    loss, metrics = mpp(torch.randn(3, 4, 16, 16))
    assert loss.isfinite() and 0 <= metrics["acc"] <= 1
    rgb = create_objective(
        "mpp", create_vit("vit_tiny_patch4_16", depth=1, embed_dim=32, num_heads=2)
    )
    assert rgb.head.out_features == 512


def test_rgb_weights_adapt_to_one_and_to_four_channels():
    w = torch.randn(8, 3, 4, 4)
    grey = torch.rand(2, 1, 4, 4)
    one = adapt_input_channels(w, 1)
    # a grey image through the summed kernel = the same image as RGB through the RGB kernel
    torch.testing.assert_close(
        F.conv2d(grey, one, stride=4), F.conv2d(grey.expand(-1, 3, -1, -1), w, stride=4)
    )
    four = adapt_input_channels(w, 4)
    assert four.shape == (8, 4, 4, 4)
    torch.testing.assert_close(four[:, :3], w * 0.75)
    torch.testing.assert_close(four[:, 3], w[:, 0] * 0.75)
    with pytest.raises(ValueError, match="only RGB weights are adapted"):
        adapt_input_channels(torch.randn(8, 2, 4, 4), 4)


def test_a_composite_shows_the_chosen_channels_or_grey():
    raw = torch.rand(2, 5, 3, 3)
    assert torch.equal(display(raw), raw[:, :3])
    assert torch.equal(display(raw, (4, 0, 2)), raw[:, [4, 0, 2]])
    assert torch.equal(display(raw[:, :1]), raw[:, :1].expand(-1, 3, -1, -1))
    back = unnormalize(
        normalize((raw * 255).round().byte(), (0.5,) * 5, (0.2,) * 5), (0.5,) * 5, (0.2,) * 5
    )
    torch.testing.assert_close(back, (raw * 255).round() / 255)


def test_auto_statistics_agree_with_numpy_on_the_same_files(tmp_path):
    bands = [RNG.integers(100, 40000, (4, 16, 18), dtype=np.uint16) for _ in range(12)]
    corrupt = b"II*\x00 not a tiff"
    samples = [(tiff(b), i % 3) for i, b in enumerate(bands)] + [(corrupt, 0)]
    shards = write_shards(
        samples, tmp_path, "t", options=WriterOptions(max_count=5, progress=False)
    )
    fmt = PixelFormat(4)
    stats = measure(shards, fmt, samples=100)
    every = np.stack([b.transpose(1, 2, 0) for b in bands]).reshape(-1, 4).astype(np.float64)
    lo, hi = every.min(), every.max()
    assert stats.images == 12 and stats.value_range == (lo, hi)
    np.testing.assert_allclose(stats.mean, (every.mean(0) - lo) / (hi - lo), rtol=1e-9)
    np.testing.assert_allclose(stats.std, every.std(0) / (hi - lo), rtol=1e-6)
    # a stated range is kept; the cache beside the shards answers the second time
    stated = measure(shards, PixelFormat(4, value_range=(0, 65535)), samples=100)
    np.testing.assert_allclose(stated.mean, every.mean(0) / 65535, rtol=1e-9)
    first, how = pixel_stats(shards, fmt, 100)
    again, how_again = pixel_stats(shards, fmt, 100)
    assert how.startswith("measured") and how_again.startswith("cached in") and again == first
    assert (tmp_path / ".mpp_stats.json").is_file()
    # a cache written before its entries were nested under "shards" still answers
    cache = tmp_path / ".mpp_stats.json"
    cache.write_text(json.dumps(json.loads(cache.read_text())["shards"]))
    old, how_old = pixel_stats(shards, fmt, 100)
    assert how_old.startswith("cached in") and old == first
    # eight-bit data: its range is 0..255, not the observed one
    eight = [RNG.integers(10, 200, (6, 6, 3), dtype=np.uint8) for _ in range(4)]
    shards8 = write_shards(
        [(e, 0) for e in eight], tmp_path / "e", "e", options=WriterOptions(progress=False)
    )
    s8 = measure(shards8, PixelFormat(3), samples=10)
    every8 = np.stack(eight).reshape(-1, 3) / 255
    assert s8.value_range == (0.0, 255.0)
    np.testing.assert_allclose(s8.mean, every8.mean(0), rtol=1e-9)


def test_data_that_needs_a_range_is_refused_before_anything_starts(tmp_path):
    """Each decodable dtype (8-bit JPEG, 16-bit PNG, 4-band uint16 and int16 TIFF, float32 npy),
    with each of data.mean / std / value_range unset, set and "auto": anything but 8-bit with no
    value_range is refused in one line naming data.value_range, whatever else is "auto" (it once
    ended every rank in a TypeError from the statistics' log line); the rest plans."""
    import itertools

    from mpp.config import ConfigError, load_config
    from mpp.train.plan import plan_run

    jpeg = io.BytesIO()
    Image.fromarray(RNG.integers(0, 256, (20, 24, 3), dtype=np.uint8)).save(jpeg, format="JPEG")
    kinds = {  # name: (bytes, channels, dtype, the range to state)
        "jpeg": (jpeg.getvalue(), 3, "uint8", [0, 255]),
        "png16": (png16(RNG.integers(0, 65536, (20, 24))), 1, "uint16", [0, 65535]),
        "tif_u16": (tiff(BANDS), 4, "uint16", [0, 65535]),
        "tif_i16": (tiff(BANDS.astype(np.int16)), 4, "int16", [-32768, 32767]),
        "npy_f32": (npy(RNG.random((20, 24, 2), dtype=np.float32)), 2, "float32", [0, 1]),
    }
    seen = {"refused": 0, "named mean/std": 0, "planned": 0}
    settings = ("unset", "set", "auto")
    for name, (data, c, dtype, stated) in kinds.items():
        eight_bit = dtype == "uint8"
        shards = write_shards(
            [(data, 0)] * 4, tmp_path / name, name, options=WriterOptions(progress=False)
        )
        spec = str(tmp_path / name / f"{name}-{{000000..{len(shards) - 1:06d}}}.tar")
        for mean, std, vr in itertools.product(settings, repeat=3):
            sets = [f'data.train_shards="{spec}"', f"data.channels={c}", "train.batch_size=2"]
            sets += ["train.max_steps=1", "data.num_workers=0"]
            for key, how, value in (
                ("mean", mean, [0.5] * c),
                ("std", std, [0.25] * c),
                ("value_range", vr, stated),
            ):
                if how != "unset":
                    sets.append(f"data.{key}=" + ('"auto"' if how == "auto" else str(value)))
            case = f"{name} mean={mean} std={std} value_range={vr}"
            try:
                cfg = load_config("mpp_demo", sets)
                plan_run(cfg, 1, "cpu", 32)
            except (ConfigError, ValueError) as e:
                message = str(e)
                unset = [k for k, how in (("mean", mean), ("std", std)) if how == "unset"]
                if vr == "unset" and not eight_bit and (c == 3 or not unset):
                    assert len(message.splitlines()) == 1, case
                    assert "data.value_range: unset, but" in message, (case, message)
                    assert f"holds {dtype} images" in message, (case, message)
                    seen["refused"] += 1
                else:  # ImageNet's 3 values for other channel counts: each named, at once
                    assert c != 3 and unset, (case, message)
                    assert len(message.splitlines()) == (1 if len(unset) == 1 else 3), case
                    for key in unset:
                        assert f"data.{key}: 3 values (ImageNet's)" in message, (case, message)
                    seen["named mean/std"] += 1
                continue
            assert eight_bit or vr != "unset", case
            seen["planned"] += 1
    # the 4 kinds that are not 8-bit have 1, 2 or 4 channels: of their 27 cases, the 15 with an
    # unset mean or std meet ImageNet's 3 values first; of the other 12, the 4 with no range are
    # refused and 8 plan. The JPEG plans all 27.
    assert seen == {"refused": 4 * 4, "named mean/std": 4 * 15, "planned": 27 + 4 * 8}, seen


def test_a_16_bit_set_is_refused_once_with_every_fix(tmp_path):
    """Issue 50, finding 4: 40 grey 16-bit PNGs under mae_demo took four runs, one refusal each
    (data.channels and the value range; data.mean; data.std; the batch). Before the process
    group: all five at once, each naming its key and its fix, the channel count that fits
    found. The plan collects as well (the census's count, num_samples, the value range); with
    no training shard found it stops there, with the layout's refusals alone."""
    from mpp.config import ConfigError, load_config
    from mpp.train.plan import check_data, plan_run

    grey16 = [(png16(RNG.integers(0, 65536, (48, 40))), i % 2) for i in range(40)]
    (shard,) = write_shards(grey16, tmp_path, "train", options=WriterOptions(progress=False))
    sets = [f"data.train_shards={shard}", "train.max_steps=1", "data.num_workers=0"]
    with pytest.raises(ConfigError) as e:
        check_data(load_config("mae_demo", sets), 32)
    config = "configs/mae_demo.json"
    keys = [f.split(": ")[1] for f in e.value.findings]
    assert keys == [
        "data.channels",
        "data.mean",
        "data.std",
        "data.value_range",
        "train.batch_size",
    ], str(e.value)
    assert all(config in f for f in e.value.findings)
    message = str(e.value)
    assert message.startswith("5 problems (all of them, each with its fix):\n"), message
    assert "holds a 48x40 uint16 array, not 3 channel(s): set data.channels=1\n" in message
    assert "data.mean: 3 values (ImageNet's), but the images hold 1 channel(s): give 1" in message
    assert "(e.g. [0, 65535])" in message and "64 exceeds the 40 samples of an epoch" in message

    # after the process group, the plan's own: the range and the census's count, at once
    sets += ["data.channels=1", 'data.mean="auto"', 'data.std="auto"', "data.num_samples=50"]
    with pytest.raises(ConfigError) as e:
        plan_run(load_config("mae_demo", sets), 1, "cpu", 32)
    keys = [f.split(": ")[1] for f in e.value.findings]
    assert keys == ["data.value_range", "data.num_samples", "train.batch_size"], str(e.value)
    assert "data.num_samples: 50, but the shards hold 40 samples" in str(e.value)

    # no training shard: nothing of the data can be read, said with the layout's refusal
    lost = ["data.train_shards=/nonexistent/x-000000.tar", "train.precision=fp16"]
    with pytest.raises(ConfigError) as e:
        plan_run(load_config("mae_demo", [*sets, *lost]), 1, "cpu", 32)
    keys = [f.split(": ")[1] for f in e.value.findings]
    assert keys == ["train.precision", "data.train_shards"], str(e.value)
    assert all(f.startswith("--set ") for f in e.value.findings), str(e.value)


def test_the_first_image_that_fits_no_channel_count_tells_its_dtype(tmp_path):
    """first_dtype (the up-front value-range check) under the default 3 channels: an 8-bit grey
    PNG is one RGB image (uint8: it plans), a 16-bit grey PNG fits no 3 channels and is its
    SampleFormatError, naming data.channels and uint16 (it once read as "no image", and the run
    started, then died skipping every sample). A misfit before a fitting image is skipped."""
    from mpp.data.stats import first_dtype

    grey8 = io.BytesIO()
    Image.fromarray(RNG.integers(0, 256, (16, 16), dtype=np.uint8)).save(grey8, format="PNG")
    for name, data in (("g8", grey8.getvalue()), ("g16", png16(RNG.integers(0, 65536, (16, 16))))):
        (shard,) = write_shards(
            [(data, 0)] * 2, tmp_path, name, options=WriterOptions(progress=False)
        )
        if name == "g8":
            assert first_dtype([shard], PixelFormat(3)) == np.uint8
            continue
        with pytest.raises(SampleFormatError, match="16x16 uint16 array, not 3 channel") as e:
            first_dtype([shard], PixelFormat(3))
        assert e.value.key == "data.channels" and e.value.dtype == np.uint16
        assert first_dtype([shard], PixelFormat(1)) == np.uint16

    # a stray 16-bit grey image first, then 8-bit RGB ones: the first that fits tells (uint8);
    # the stray one is a skipped sample, not a refused run
    rgb = io.BytesIO()
    Image.fromarray(RNG.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(rgb, format="JPEG")
    mixed = [(png16(RNG.integers(0, 65536, (16, 16))), 0)] + [(rgb.getvalue(), 0)] * 3
    (shard,) = write_shards(
        mixed, tmp_path, "mixed", options=WriterOptions(seed=None, progress=False)
    )
    assert first_dtype([shard], PixelFormat(3)) == np.uint8
    # 8-bit images that fit no data.channels either (RGB JPEGs under 1 or 4): refused all the same
    # (they once passed, and the run died of 100 skipped samples)
    (shard,) = write_shards(
        [(rgb.getvalue(), 0)] * 3, tmp_path, "rgb", options=WriterOptions(progress=False)
    )
    for channels in (1, 4):
        with pytest.raises(
            SampleFormatError, match=f"16x16x3 uint8 array, not {channels} channel"
        ) as e:
            first_dtype([shard], PixelFormat(channels))
        assert e.value.key == "data.channels" and e.value.dtype == np.uint8
