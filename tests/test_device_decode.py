"""``data.decode=gpu`` on the CPU (issue 36 §3): the workers leave JPEGs undecoded with the crop
box and flip the CPU path draws, the loader carries them to their place in the batch, and the
device-side crop-resize-flip matches PIL's; with PIL standing in for nvJPEG (torchvision, which has
it, does not install beside this CPU torch). The nvJPEG decode itself is tested where CUDA is."""

from __future__ import annotations

import collections
import io
import random
import tarfile

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_config, write_tar
from PIL import Image
from torch.utils._python_dispatch import TorchDispatchMode

from mpp.config import Config, ConfigError
from mpp.data import device_decode, make_train_loader
from mpp.data.resize import crop_resize_flip
from mpp.data.transforms import (
    Deferred,
    DeferredBatch,
    collate,
    random_resized_crop_box,
    train_transform,
)

S = 32
CPU = torch.device("cpu")


def photo(width: int, height: int, seed: int, grey: bool = False) -> np.ndarray:
    """A smooth image with texture, as photographs are: low-frequency colour fields plus noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width] / max(width, height)
    phase = rng.uniform(0, 6.3, (3, 3))
    chans = [
        128 + 80 * np.sin(6 * x * phase[c, 0] + 4 * y * phase[c, 1] + phase[c, 2]) for c in range(3)
    ]
    array = np.stack(chans, axis=2) + rng.normal(0, 12, (height, width, 3))
    array = np.clip(array, 0, 255).astype(np.uint8)
    return array[:, :, :1].repeat(3, axis=2) if grey else array


def encode(array: np.ndarray, fmt: str = "JPEG", grey: bool = False) -> bytes:
    buf = io.BytesIO()
    image = Image.fromarray(array)
    (image.convert("L") if grey else image).save(buf, fmt, quality=92)
    return buf.getvalue()


def deferred_batch(samples: list[Deferred]) -> torch.Tensor:
    batch = collate([(d, None, f"k{i}") for i, d in enumerate(samples)], img_size=S)
    assert "image" not in batch  # every sample deferred: no placeholder on the host
    return device_decode.fill_deferred(None, batch["deferred"], device_decode.on_host, CPU)


def test_deferred_jpegs_crop_resize_and_flip_as_the_cpu_path():
    """The same seeds draw the same box and flip with and without ``defer_jpeg``. The device path
    (full decode, torch's antialiased bicubic) lands within 0.2 grey levels on average of PIL's
    bicubic resize of the same box from a full decode (measured 0.16, 99th percentile 1); the CPU
    path decodes big crops at 1/2..1/8 scale first (JPEG draft), which at 32 px from ~400-px photos
    moves it further (1.5 on average), flips included."""
    sizes = [(500, 375), (375, 500), (256, 256), (640, 480)] * 3
    cpu, full, deferred = [], [], []
    for i, (w, h) in enumerate(sizes):
        grey = i == 5
        data = encode(photo(w, h, i, grey), grey=grey)
        cpu.append(train_transform(data, S, random.Random(f"s{i}")))
        d = train_transform(data, S, random.Random(f"s{i}"), defer_jpeg=True)
        assert isinstance(d, Deferred) and d.data == data
        deferred.append(d)
        image = Image.open(io.BytesIO(data)).convert("RGB")
        resized = np.asarray(image.resize((S, S), Image.Resampling.BICUBIC, box=d.box))
        full.append(resized[:, ::-1] if d.flip else resized)
    assert any(d.flip for d in deferred) and not all(d.flip for d in deferred)
    got = deferred_batch(deferred).permute(0, 2, 3, 1).numpy().astype(np.float32)
    vs_pil = np.abs(got - np.stack(full).astype(np.float32))
    assert vs_pil.mean() < 0.5 and np.percentile(vs_pil, 99) <= 2, (vs_pil.mean(), vs_pil.max())
    want = np.stack(cpu).astype(np.float32)
    diff = np.abs(got - want)
    assert diff.mean() < 2.5, (diff.mean(), diff.max())
    # a wrong flip or box is far off: the same crops unflipped differ by tens of levels
    assert np.abs(got[:, :, ::-1] - want).mean() > 4 * diff.mean()


def test_only_what_nvjpeg_decodes_as_the_cpu_path_is_deferred():
    """PNGs, CMYK JPEGs, other channel counts and RandAugment stay on the workers' CPU path."""
    array = photo(64, 48, 0)
    rng = lambda: random.Random(0)  # noqa: E731
    assert isinstance(train_transform(encode(array), S, rng(), defer_jpeg=True), Deferred)
    truncated = encode(array)[:-200]  # cut: the workers' decode fails and skips it, as ever
    for data in (encode(array, "PNG"), cmyk_jpeg(array)):
        assert isinstance(train_transform(data, S, rng(), defer_jpeg=True), np.ndarray)
    with pytest.raises(OSError):  # PIL: image file is truncated
        train_transform(truncated, S, rng(), defer_jpeg=True)
    from mpp.data.transforms import Augmentation

    randaug = Augmentation(randaug=(2, 9))
    out = train_transform(encode(array), S, rng(), aug=randaug, defer_jpeg=True)
    assert isinstance(out, np.ndarray)


def test_a_file_nvjpeg_refuses_is_decoded_on_the_host_and_one_nothing_reads_is_black(
    monkeypatch,
):
    """nvJPEG's batch call fails as a whole when one file is beyond it: then file by file, the
    failing ones by PIL on the host, and one that nothing decodes becomes a black image with a
    warning naming its key (the step goes on; the workers skip what fails their own parse)."""
    good = [encode(photo(120, 90, i)) for i in range(3)]
    header = good[0][:600]  # a JPEG header, then garbage: parses, never decodes
    broken = header + bytes(range(256)) * 8 + b"\xff\xd9"
    entries = [
        (i, Deferred(data, (0, 0, 60, 60), False), f"k{i}")
        for i, data in enumerate([*good, broken])
    ]
    calls = []

    def picky(files):  # nvJPEG's behaviour: one file it cannot read fails the whole call
        calls.append(len(files))
        if len(files) > 1 or files[0].numel() == len(good[2]):
            raise RuntimeError("nvjpeg: unsupported")
        return device_decode.on_host(files)

    images = torch.full((4, 3, S, S), 7, dtype=torch.uint8)
    warned = []  # the module's logger itself: another test's logging set-up may stop propagation
    monkeypatch.setattr(device_decode.log, "warning", lambda *a: warned.append(a[0] % a[1:]))
    out = device_decode.fill_deferred(images, DeferredBatch.of(entries, 4, S), picky, CPU)
    assert calls == [4, 1, 1, 1, 1]  # the batch, then each file
    reference = device_decode.fill_deferred(
        None, DeferredBatch.of(entries[:3], 3, S), device_decode.on_host, CPU
    )
    assert torch.equal(out[:3], reference)  # k2 by the host fallback, the same pixels
    assert int(out[3].max()) == 0 and "sample k3: cannot decode" in warned[0]


def per_image(images: list, boxes: list, flips: list, size: int) -> torch.Tensor:
    """The crop-resize-flip as it was before issue 49 §2, the reference: a loop over the batch,
    several kernels per image (float, F.interpolate, round, clamp, flip, cast, copy)."""
    out = torch.zeros(len(images), 3, size, size, dtype=torch.uint8)
    for i, (image, box, flip) in enumerate(zip(images, boxes, flips, strict=True)):
        if image.shape[-2:] == (1, 1):  # nothing decoded it
            continue
        left, top, right, bottom = (int(v) for v in box)
        crop = image[None, :, top:bottom, left:right].float()
        resized = F.interpolate(
            crop, size=(size, size), mode="bicubic", antialias=True, align_corners=False
        )
        resized = resized.round_().clamp_(0, 255)[0]
        out[i] = (resized.flip(-1) if flip else resized).to(torch.uint8)
    return out


@pytest.mark.parametrize("size", [32, 224])
def test_the_batched_crop_is_the_per_image_interpolate_within_one_grey_level(size):
    """One crop-resize-flip for the whole batch (host weights, a gather and two bmms per size
    group) against F.interpolate image by image: mixed sizes and orientations, crops that are
    upscaled (smaller than S), a grey JPEG, 1-pixel-wide, -high and 1 x 1 boxes, and an entry
    nothing decoded (a black (3, 1, 1) image whose box is the header's), flipped and not."""
    rng = random.Random(size)
    sizes = [(500, 375), (375, 500), (256, 256), (20, 30), (64, 48), (9, 300), (640, 480)] * 2
    files = [encode(photo(w, h, i, grey=i == 4), grey=i == 4) for i, (w, h) in enumerate(sizes)]
    images = device_decode.on_host(
        [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in files]
    )
    boxes = [random_resized_crop_box(w, h, rng) for w, h in sizes]
    boxes[:4] = [(5, 0, 6, 375), (0, 7, 375, 8), (100, 100, 101, 101), (2, 3, 12, 25)]
    images.append(torch.zeros(3, 1, 1, dtype=torch.uint8))
    boxes.append((10, 20, 210, 170))
    flips = [i % 3 == 0 for i in range(len(images))]
    got = crop_resize_flip(images, boxes, flips, size)
    want = per_image(images, boxes, flips, size)
    assert got.shape == want.shape == (len(images), 3, size, size) and got.dtype == torch.uint8
    diff = (got.int() - want.int()).abs()
    assert int(diff.max()) <= 1, [int(d.max()) for d in diff]
    assert float((diff > 0).float().mean()) < 1e-3  # a rounding at .5 now and then
    assert int(got[-1].max()) == 0
    # the flips are the x axis reversed: unflipped, the flipped crops are far off
    assert flips[6] and (got[6].flip(-1).int() - want[6].int()).abs().float().mean() > 5


# ops that launch no work: views and metadata, and an allocation
NO_LAUNCH = set(
    "view _unsafe_view reshape as_strided expand t permute unsqueeze squeeze slice select alias "
    "detach transpose empty".split()
)


class Launches(TorchDispatchMode):
    """The ATen ops that launch work, by name."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func.overloadpacket.__name__ in NO_LAUNCH):
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def launches(crop, n: int) -> int:
    """How many ops ``crop`` runs for a batch of ``n`` decoded images of mixed sizes to 16 px."""
    rng, gen = random.Random(n), torch.Generator().manual_seed(n)
    sizes = [(rng.randint(8, 120), rng.randint(8, 120)) for _ in range(n)]
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen) for w, h in sizes]
    boxes = [random_resized_crop_box(w, h, rng) for w, h in sizes]
    flips = [rng.random() < 0.5 for _ in sizes]
    with Launches() as counted:
        crop(images, boxes, flips, 16)
    return sum(counted.ops.values())


def test_the_batched_crop_launches_as_many_ops_for_256_images_as_for_64():
    """Issue 49 §2: the crops' kernel launches do not grow with the batch (measured 57 and 57 ops
    on the CPU, against 415 and 1,660 for the loop over images: 28-38 ms per batch of 256 on an
    H200, mostly per-image costs)."""
    new = launches(crop_resize_flip, 64), launches(crop_resize_flip, 256)
    old = launches(per_image, 64), launches(per_image, 256)
    assert new[1] <= 1.2 * new[0], new
    assert old[1] >= 3.5 * old[0], old  # the count that would fail it


def cmyk_jpeg(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).convert("CMYK").save(buf, "JPEG")
    return buf.getvalue()


def test_the_loader_carries_deferred_jpegs_to_their_place_in_the_batch(tmp_path):
    """Mixed JPEG and PNG shards, 2 workers each holding part of every micro-batch, 2 ranks'
    streams: with ``defer_jpeg`` the same keys in the same order, the PNGs decoded by the workers
    exactly as before, and each JPEG listed at its own place, filled as the CPU path fills it."""
    shards = []
    for s in range(3):
        members = []
        for j in range(7 + s):  # uneven shards
            n = 10 * s + j
            ext = "png" if n % 3 == 0 else "jpg"
            data = encode(photo(90, 70, n), "PNG" if ext == "png" else "JPEG")
            members.append((f"{n:06d}.{ext}", data))
            members.append((f"{n:06d}.cls", str(n % 4).encode()))
        shards.append(write_tar(tmp_path / f"s{s}.tar", members))
    settings = dict(
        batch_size=3, img_size=S, num_batches=4, with_labels=True, num_classes=4, with_keys=True
    )
    all_deferred = 0
    for rank in range(2):
        common = dict(settings, rank=rank, world_size=2)
        cpu = list(make_train_loader(shards, num_workers=2, **common))
        gpu = list(make_train_loader(shards, num_workers=2, defer_jpeg=True, **common))
        assert len(cpu) == len(gpu) == 4
        for a, b in zip(cpu, gpu, strict=True):
            assert a["key"] == b["key"] and torch.equal(a["label"], b["label"])
            d = b.get("deferred")
            places = d.places.tolist() if d is not None else []
            assert (d.keys if d else []) == [b["key"][p] for p in places]
            assert places == [i for i, k in enumerate(b["key"]) if is_jpeg(k, shards)]
            pngs = [i for i in range(len(b["key"])) if i not in places]
            if pngs:
                assert torch.equal(a["image"][pngs], b["image"][pngs])
            else:  # nothing decoded on the host: no placeholder batch
                assert "image" not in b
                all_deferred += 1
            if places:  # the files end to end in one buffer, byte for byte the members
                assert d.files.dtype == torch.uint8 and len(d.offsets) == len(places) + 1
                first = bytes(d.files[d.offsets[0] : d.offsets[1]].numpy())
                assert first == member(d.keys[0], "jpg")
                image = b["image"].clone() if pngs else None
                filled = device_decode.fill_deferred(image, d, device_decode.on_host, CPU)
                diff = (filled[places].float() - a["image"][places].float()).abs()
                assert diff.mean() < 3.0, diff.mean()
    assert all_deferred > 0


def member(key: str, ext: str) -> bytes:
    url, name = key.split("#")
    with tarfile.open(url) as tar:
        return tar.extractfile(f"{name}.{ext}").read()


def is_jpeg(key: str, shards: list[str]) -> bool:
    url, name = key.split("#")
    with tarfile.open(url) as tar:
        return f"{name}.jpg" in tar.getnames()


def test_data_decode_gpu_without_a_gpu_is_refused_naming_the_key(digits16, tmp_path):
    """``cpu`` never defers; ``auto`` defers only on a GPU with nvJPEG; ``gpu`` where it cannot run
    is one line naming ``data.decode`` and the config, before anything starts."""
    cpu = torch.device("cpu")
    assert device_decode.resolve("cpu", cpu) is False
    assert device_decode.resolve("auto", cpu) is False
    with pytest.raises(ValueError, match="data.decode=gpu: device cpu is not a GPU"):
        device_decode.resolve("gpu", cpu)
    from mpp.train.plan import plan_run

    cfg = Config.model_validate(tiny_config(digits16, data={"decode": "gpu"}))
    with pytest.raises(ConfigError, match=r"data\.decode.*not a GPU"):
        plan_run(cfg, 1, "cpu", 16)
    plan = plan_run(Config.model_validate(tiny_config(digits16)), 1, "cpu", 16)
    assert plan.stream.defer_jpeg is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (nvJPEG)")
def test_nvjpeg_fills_the_batch_as_pil_does_on_a_gpu():
    """On a GPU: torchvision's nvJPEG batch decode, the crops on the device, against PIL's."""
    pytest.importorskip("torchvision", reason="the gpu extra's torchvision brings nvJPEG")
    device = torch.device("cuda")
    assert device_decode.nvjpeg_refusal(device) == "", device_decode.nvjpeg_refusal(device)
    samples = [
        train_transform(encode(photo(500, 375, i)), S, random.Random(i), defer_jpeg=True)
        for i in range(8)
    ]
    batch = collate([(d, None, "k") for d in samples], img_size=S)
    got = device_decode.fill_deferred(None, batch["deferred"], device_decode.nvjpeg(device), device)
    want = deferred_batch(samples)
    assert (got.cpu().float() - want.float()).abs().mean() < 2.0
