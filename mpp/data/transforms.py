"""CPU image transforms in PIL and numpy (no torchvision): decode of any pixel format
(``PixelFormat``), RandomResizedCrop, flip, eval resize + centre crop, collation
(docs/ARCHITECTURE.md §3.4, §4.8)."""

from __future__ import annotations

import io
import itertools
import math
import random
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

IMAGE_KEYS = ("jpg", "jpeg", "png", "webp", "npy", "tif", "tiff")
# resize the short side to img_size / 0.875, then center crop (timm's default)
EVAL_CROP_PCT = 0.875

Box = tuple[float, float, float, float]  # (left, upper, right, lower) in source pixels


class SampleFormatError(ValueError):
    """A sample that is not what the data section says (channels, dtype, layout): skipped.
    ``key``: the setting it does not fit (``data.channels`` / ``data.layout``) and ``dtype``: the
    array's, where those say it (``mpp.train.plan.check_value_range`` refuses from them)."""

    def __init__(self, message: str, key: str | None = None, dtype: np.dtype | None = None):
        super().__init__(message)
        self.key, self.dtype = key, dtype


@dataclass(frozen=True)
class PixelFormat:
    """What every sample holds: ``channels``; ``layout`` ("HWC" | "CHW") for arrays whose shape
    cannot say; ``value_range`` (lo, hi) mapped to [0, 1] for data that is not 8-bit."""

    channels: int = 3
    layout: str | None = None
    value_range: tuple[float, float] | None = None


RGB = PixelFormat()


def sniff_format(data: bytes) -> str | None:
    """'jpeg' | 'png' | 'webp' | 'npy' | 'tiff' from the magic bytes, None for anything else."""
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if data[:6] == b"\x93NUMPY":
        return "npy"
    if data[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return "tiff"
    return None


def decode(data: bytes, fmt: PixelFormat = RGB, scale: bool = True) -> Image.Image | np.ndarray:
    """Encoded bytes -> a PIL image (8-bit, ``fmt.channels`` 1 or 3: the fast path) or an HWC
    array (anything else: uint8, or float32 in [0, 1] through ``fmt.value_range``; ``scale``
    False: in its own dtype)."""
    kind = sniff_format(data)
    if kind == "npy":
        return to_hwc(np.load(io.BytesIO(data), allow_pickle=False), fmt, scale)
    if kind == "tiff":
        import tifffile

        return to_hwc(tifffile.imread(io.BytesIO(data)), fmt, scale)
    img = open_image(data)
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):  # 16-bit or float PNG/TIFF through PIL
        return to_hwc(np.asarray(img), fmt, scale)
    if fmt.channels == 3:  # grey, CMYK, palette JPEGs and PNGs: RGB, as ever
        return img
    if fmt.channels == 1 and img.mode in ("L", "P", "LA", "1"):
        return img.convert("L") if img.mode != "L" else img
    return to_hwc(np.asarray(img), fmt, scale)


def raw_array(data: bytes, fmt: PixelFormat = RGB) -> np.ndarray:
    """Encoded bytes -> the whole image as an HWC array of ``fmt.channels`` in its own dtype
    (what ``mpp.data.stats`` measures); SampleFormatError as ``decode``."""
    img = decode(data, PixelFormat(fmt.channels, fmt.layout, (0.0, 1.0)), scale=False)
    if isinstance(img, np.ndarray):
        return img
    img = img.convert("RGB") if fmt.channels == 3 and img.mode != "RGB" else img
    array = np.asarray(img)
    return array[:, :, None] if array.ndim == 2 else array


def to_hwc(array: np.ndarray, fmt: PixelFormat, scale: bool = True) -> np.ndarray:
    """An array from a file -> HWC of ``fmt.channels``, uint8 or float32 in [0, 1] (``scale``;
    else in its own dtype); SampleFormatError saying what it holds when it does not fit."""
    a, c = np.asarray(array), fmt.channels
    what = f"a {'x'.join(map(str, a.shape))} {a.dtype} array"
    if a.ndim == 2 and c == 1:
        a = a[:, :, None]
    elif a.ndim == 3 and fmt.layout is not None:
        a = a if fmt.layout == "HWC" else a.transpose(1, 2, 0)
    elif a.ndim == 3 and a.shape[2] == c and a.shape[0] != c:
        pass
    elif a.ndim == 3 and a.shape[0] == c and a.shape[2] != c:
        a = a.transpose(1, 2, 0)
    elif a.ndim == 3 and a.shape[0] == a.shape[2] == c:
        raise SampleFormatError(
            f"holds {what}: set data.layout (HWC or CHW) to say which", "data.layout", a.dtype
        )
    if a.ndim != 3 or a.shape[2] != c:
        raise SampleFormatError(
            f"holds {what}, not {c} channel(s) (data.channels)", "data.channels", a.dtype
        )
    if not scale or (a.dtype == np.uint8 and fmt.value_range in (None, (0, 255))):
        return np.ascontiguousarray(a)
    if fmt.value_range is None:
        raise SampleFormatError(
            f"holds {what}: data.value_range must say what [0, 1] is for {a.dtype} data"
        )
    if a.dtype.kind not in "uif":
        raise SampleFormatError(f"holds {what}: not a number type")
    lo, hi = fmt.value_range
    out = (a.astype(np.float32) - np.float32(lo)) / np.float32(hi - lo)
    return np.clip(out, 0.0, 1.0, out=out)


def open_image(data: bytes) -> Image.Image:
    """Parse the header only; pixels are decoded later, after `draft`."""
    return Image.open(io.BytesIO(data))


def random_resized_crop_box(
    width: int, height: int, rng: random.Random, scale=(0.2, 1.0), ratio=(3 / 4, 4 / 3)
) -> Box:
    """torchvision's RandomResizedCrop.get_params: 10 tries at a random area/aspect, else center."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(*log_ratio))
        w = round(math.sqrt(target_area * aspect))
        h = round(math.sqrt(target_area / aspect))
        if 0 < w <= width and 0 < h <= height:
            top = rng.randint(0, height - h)
            left = rng.randint(0, width - w)
            return (left, top, left + w, top + h)
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, round(width / min(ratio))
    elif in_ratio > max(ratio):
        w, h = round(height * max(ratio)), height
    else:
        w, h = width, height
    top, left = (height - h) // 2, (width - w) // 2
    return (left, top, left + w, top + h)


def center_crop_box(width: int, height: int, img_size: int, crop_pct: float = EVAL_CROP_PCT) -> Box:
    """The source region that resize(short side -> img_size / crop_pct) + center crop keeps."""
    short = math.floor(img_size / crop_pct)
    factor = short / min(width, height)  # resized pixels per source pixel
    new_w, new_h = round(width * factor), round(height * factor)
    left, top = (new_w - img_size) / 2, (new_h - img_size) / 2
    # round the crop offset in resized pixels as torchvision's CenterCrop does, then map back
    left, top = round(left), round(top)
    sx, sy = width / new_w, height / new_h
    return (left * sx, top * sy, (left + img_size) * sx, (top + img_size) * sy)


def crop_resize(
    img: Image.Image | np.ndarray, box: Box, img_size: int, channels: int = 3
) -> np.ndarray:
    """Decode only as much as needed (JPEG draft), then one bicubic resize of ``box`` -> (S, S, C):
    a grey image RGB for ``channels`` 3; an array a channel at a time (``resize_channels``)."""
    if isinstance(img, np.ndarray):
        return resize_channels(img, box, img_size)
    width, height = img.size
    crop_w, crop_h = box[2] - box[0], box[3] - box[1]
    if img.format == "JPEG":
        # DCT-domain downscale by 1/2, 1/4 or 1/8 while the crop stays >= img_size: decode cost
        # drops with the square of the factor and the result is at least as sharp.
        want = (math.ceil(width * img_size / crop_w), math.ceil(height * img_size / crop_h))
        img.draft("RGB" if channels == 3 else "L", want)
        if img.size != (width, height):
            sx, sy = img.size[0] / width, img.size[1] / height
            box = (box[0] * sx, box[1] * sy, box[2] * sx, box[3] * sy)
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    out = img.resize((img_size, img_size), Image.Resampling.BICUBIC, box=box)
    if out.mode == "L" and channels == 3:
        out = out.convert("RGB")  # after the resize: a third of the pixels to resample
    array = np.asarray(out)
    return array[:, :, None] if array.ndim == 2 else array


def resize_channels(array: np.ndarray, box: Box, img_size: int) -> np.ndarray:
    """HWC uint8 or float32 -> (S, S, C) of the same dtype: each channel bicubic-resized from
    ``box`` by PIL ("L" for uint8, "F" for float32), the same boxes as the RGB path; floats
    clipped to [0, 1] afterwards, as 8-bit pixels are (bicubic overshoots at sharp edges)."""
    mode = "L" if array.dtype == np.uint8 else "F"
    planes = [
        np.asarray(
            Image.fromarray(np.ascontiguousarray(array[:, :, c]), mode).resize(
                (img_size, img_size), Image.Resampling.BICUBIC, box=box
            )
        )
        for c in range(array.shape[2])
    ]
    out = np.stack(planes, axis=2)
    return out if mode == "L" else np.clip(out, 0.0, 1.0, out=out)


def _size(img: Image.Image | np.ndarray) -> tuple[int, int]:
    """(width, height) of a PIL image or an HWC array."""
    return img.size if isinstance(img, Image.Image) else (img.shape[1], img.shape[0])


@dataclass(frozen=True)
class Augmentation:
    """The training crop: RandomResizedCrop's ``scale`` and ``ratio``, the flip probability and
    RandAugment's (n, m) (None: off; 8-bit RGB only)."""

    scale: tuple[float, float] = (0.2, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    randaug: tuple[int, int] | None = None


@dataclass(frozen=True)
class Deferred:
    """A JPEG left for the device to decode (``data.decode=gpu``, ``mpp.data.device_decode``):
    its bytes, and the crop box and flip drawn for it here, as the CPU path would have drawn them."""

    data: bytes  # the encoded file (bytes cross the worker queue pickled, not one shm each)
    box: Box
    flip: bool


def train_transform(
    data: bytes,
    img_size: int,
    rng: random.Random,
    aug: Augmentation = Augmentation(),
    fmt: PixelFormat = RGB,
    defer_jpeg: bool = False,
) -> np.ndarray | Deferred:
    """Encoded bytes -> RandomResizedCrop (bicubic) + horizontal flip [+ RandAugment(n, m), 8-bit
    RGB only] -> (S, S, C) view, uint8 or float32 (``fmt``). ``defer_jpeg``: an RGB or grey JPEG
    (RGB data, no RandAugment) is only parsed here, its box and flip drawn: a ``Deferred``."""
    img = decode(data, fmt)
    box = random_resized_crop_box(*_size(img), rng, aug.scale, aug.ratio)
    flip = rng.random() < aug.hflip
    if defer_jpeg and deferrable(img, fmt, aug) and complete_jpeg(data):
        return Deferred(bytes(data), box, flip)
    array = crop_resize(img, box, img_size, fmt.channels)
    if aug.randaug is not None and aug.randaug[0] > 0:
        from .randaug import rand_augment

        if array.dtype != np.uint8 or array.shape[2] != 3:
            raise SampleFormatError("RandAugment's PIL ops need 8-bit RGB")
        array = np.asarray(
            rand_augment(Image.fromarray(np.ascontiguousarray(array)), rng, *aug.randaug)
        )
    return array[:, ::-1] if flip else array  # a view: the copy into the batch does the flip


def deferrable(img: Image.Image | np.ndarray, fmt: PixelFormat, aug: Augmentation) -> bool:
    """What nvJPEG decodes to what the CPU path makes: a baseline or progressive RGB or grey JPEG
    (not CMYK), for 3-channel 8-bit data without RandAugment (PIL ops on the host)."""
    return (
        isinstance(img, Image.Image)
        and img.format == "JPEG"
        and img.mode in ("RGB", "L")
        and fmt == RGB
        and not (aug.randaug and aug.randaug[0] > 0)
    )


def complete_jpeg(data: bytes) -> bool:
    """The file ends in JPEG's end-of-image marker (trailing padding allowed): a truncated one is
    decoded by the workers, whose failure skips the sample as any corrupt image's does."""
    return data.rstrip(b"\x00")[-2:] == b"\xff\xd9"


def eval_transform(
    data: bytes, img_size: int, rng: random.Random | None = None, fmt: PixelFormat = RGB
) -> np.ndarray:
    """Encoded bytes -> resize short side to img_size / 0.875 (bicubic) + center crop -> (S, S, C)."""
    img = decode(data, fmt)
    return crop_resize(img, center_crop_box(*_size(img), img_size), img_size, fmt.channels)


@dataclass
class DeferredBatch:
    """A batch's JPEGs left for the device (``data.decode=gpu``): the files end to end in one
    uint8 buffer (``offsets``: where each starts, and the end), each with its place in the batch,
    crop box and flip; ``size``: the batch's samples, deferred or not; ``img_size``: the side they
    are cropped to. Tensors, so a worker hands them over in shared memory, not pickled bytes."""

    files: torch.Tensor  # (total bytes,) uint8
    offsets: torch.Tensor  # (n + 1,) int64
    places: torch.Tensor  # (n,) int64
    boxes: torch.Tensor  # (n, 4) float64, (left, upper, right, lower)
    flips: torch.Tensor  # (n,) bool
    keys: list[str]
    size: int
    img_size: int

    @classmethod
    def of(
        cls, entries: list[tuple[int, Deferred, str]], size: int, img_size: int
    ) -> DeferredBatch:
        """From (place, ``Deferred``, key) entries of a batch of ``size`` samples."""
        ends = [0, *itertools.accumulate(len(d.data) for _, d, _ in entries)]
        files = torch.empty(ends[-1], dtype=torch.uint8)
        buffer = files.numpy()
        for (_, d, _), start, end in zip(entries, ends, ends[1:], strict=False):
            buffer[start:end] = np.frombuffer(d.data, np.uint8)
        return cls(
            files,
            torch.tensor(ends, dtype=torch.int64),
            torch.tensor([p for p, _, _ in entries], dtype=torch.int64),
            torch.tensor([d.box for _, d, _ in entries], dtype=torch.float64).reshape(-1, 4),
            torch.tensor([d.flip for _, d, _ in entries], dtype=torch.bool),
            [k for _, _, k in entries],
            size,
            img_size,
        )

    @classmethod
    def join(cls, parts: list[DeferredBatch | None], sizes: list[int]) -> DeferredBatch | None:
        """The parts of one batch (None: a part with nothing deferred) of ``sizes`` samples each,
        end to end."""
        starts = [0, *itertools.accumulate(sizes)]
        kept = [(p, start) for p, start in zip(parts, starts, strict=False) if p is not None]
        if not kept:
            return None
        file_starts = itertools.accumulate([0] + [len(p.files) for p, _ in kept])
        return cls(
            torch.cat([p.files for p, _ in kept]),
            torch.cat(
                [torch.tensor([0])]
                + [p.offsets[1:] + at for (p, _), at in zip(kept, file_starts, strict=False)]
            ),
            torch.cat([p.places + start for p, start in kept]),
            torch.cat([p.boxes for p, _ in kept]),
            torch.cat([p.flips for p, _ in kept]),
            [k for p, _ in kept for k in p.keys],
            starts[-1],
            kept[0][0].img_size,
        )

    def file_list(self) -> list[torch.Tensor]:
        """Each file as a view of the buffer (what nvJPEG's batched call takes)."""
        ends = self.offsets.tolist()
        return [self.files[a:b] for a, b in zip(ends[:-1], ends[1:], strict=True)]


def collate(
    samples: list[tuple[np.ndarray | Deferred, int | None, str]],
    with_keys: bool = False,
    img_size: int | None = None,
) -> dict:
    """List of (HWC array, label, key) -> {"image": (B, C, H, W) contiguous, "label": (B,)}: uint8
    when every sample is, else float32 in [0, 1] (an 8-bit sample divided by 255). ``Deferred``
    samples (RGB uint8, ``img_size``) go to "deferred" (a ``DeferredBatch``) for the device to
    fill; their places in "image" are left empty, and with every sample deferred there is no
    "image" at all."""
    deferred = [(i, s[0], s[2]) for i, s in enumerate(samples) if isinstance(s[0], Deferred)]
    batch: dict = {}
    if deferred:
        batch["deferred"] = DeferredBatch.of(deferred, len(samples), img_size)
    if len(deferred) < len(samples):
        batch["image"] = _stack([s[0] for s in samples])
    if samples[0][1] is not None:
        batch["label"] = torch.tensor([s[1] for s in samples], dtype=torch.int64)
    if with_keys:
        batch["key"] = [s[2] for s in samples]
    return batch


def _stack(arrays: list[np.ndarray | Deferred]) -> torch.Tensor:
    """(B, C, H, W): each HWC array in its place (one copy each), a ``Deferred``'s left empty."""
    decoded = [a for a in arrays if not isinstance(a, Deferred)]
    h, w, c = decoded[0].shape
    floats = any(a.dtype != np.uint8 for a in decoded)
    images = torch.empty((len(arrays), c, h, w), dtype=torch.float32 if floats else torch.uint8)
    out = images.numpy()
    for i, array in enumerate(arrays):
        if isinstance(array, Deferred):
            continue
        # the one copy per image: HWC (maybe flipped) -> CHW
        if floats and array.dtype == np.uint8:
            out[i] = array.transpose(2, 0, 1) / np.float32(255)
        else:
            out[i] = array.transpose(2, 0, 1)
    return images
