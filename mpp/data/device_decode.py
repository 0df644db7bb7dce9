"""JPEGs decoded on the GPU (``data.decode``): one batched nvJPEG call per batch, then one
crop-resize-flip on the device (``mpp.data.resize.crop_resize_flip``) with the crop boxes and
flips the workers drew (``mpp.data.transforms.Deferred``) (docs/ARCHITECTURE.md §3.4)."""

from __future__ import annotations

import io
import logging
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from .resize import crop_resize_flip, packed_copy
from .transforms import DeferredBatch

log = logging.getLogger(__name__)

# encoded files (n,) uint8 on the host -> decoded (3, H, W) uint8 on the device
Decoder = Callable[[list[Tensor]], list[Tensor]]


def nvjpeg_refusal(device: torch.device) -> str:
    """Why this process cannot decode JPEGs on ``device`` ("" when it can): no CUDA device, or no
    torchvision with nvJPEG (one tiny decode tried, as the xformers check does)."""
    if device.type != "cuda":
        return f"device {device.type} is not a GPU"
    try:
        from torchvision.io import ImageReadMode, decode_jpeg

        buffer = io.BytesIO()
        Image.new("RGB", (16, 16), (10, 20, 30)).save(buffer, "JPEG")
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        decode_jpeg([data], mode=ImageReadMode.RGB, device=device)
    except Exception as e:  # ImportError, or a torchvision built without nvJPEG
        return f"torchvision's nvJPEG decode is not available ({e.__class__.__name__}: {e})"
    return ""


def resolve(mode: str, device: torch.device) -> bool:
    """``data.decode`` -> whether the JPEGs are decoded on ``device``: gpu (or an error saying
    why not), cpu, or auto (on a GPU: the GPU where nvJPEG runs, with one log line either way)."""
    if mode == "cpu" or (mode == "auto" and device.type != "cuda"):
        return False
    why_not = nvjpeg_refusal(device)
    if mode == "gpu" and why_not:
        raise ValueError(f"data.decode=gpu: {why_not}")
    where = "the GPU (nvJPEG)" if not why_not else f"the CPU: {why_not}"
    log.info("data.decode=%s: training JPEGs decoded on %s", mode, where)
    return not why_not


def nvjpeg(device: torch.device) -> Decoder:
    """torchvision's batched nvJPEG decode onto ``device``, grey JPEGs as RGB. Called on a side
    stream that first waits for the current one: nvJPEG allocates its outputs on the calling
    stream and decodes on a private one without waiting (pytorch/vision#9606), so on the training
    stream the caching allocator could hand it memory that queued kernels still read."""
    from torchvision.io import ImageReadMode, decode_jpeg

    side = torch.cuda.Stream(device)

    def decode(files: list[Tensor]) -> list[Tensor]:
        current = torch.cuda.current_stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            images = decode_jpeg(files, mode=ImageReadMode.RGB, device=device)
        current.wait_stream(side)
        for image in images:
            image.record_stream(current)
        return images

    return decode


def on_host(files: list[Tensor]) -> list[Tensor]:
    """The same interface on the CPU, through PIL: each file's (3, H, W) uint8 (grey as RGB),
    contiguous as nvJPEG's (``crop_resize_flip`` packs them as views)."""
    out = []
    for f in files:
        image = Image.open(io.BytesIO(f.numpy().tobytes())).convert("RGB")
        out.append(torch.from_numpy(np.array(image).transpose(2, 0, 1).copy()))
    return out


def decode_each(files: list[Tensor], keys: list[str], decode: Decoder, device) -> list[Tensor]:
    """The batch in one call; if it fails (one file nvJPEG cannot read: arithmetic coding,
    lossless, damage past the header), file by file, those failing again by PIL on the host, and
    a file nothing decodes as a black image, with a warning naming its key."""
    try:
        return decode(files)
    except Exception:
        pass
    out = []
    for f, key in zip(files, keys, strict=True):
        try:
            out.append(decode([f])[0])
            continue
        except Exception:
            pass
        try:
            out.append(on_host([f])[0].to(device))
        except Exception as e:
            log.warning("sample %s: cannot decode (%r): a black image in its place", key, e)
            out.append(torch.zeros(3, 1, 1, dtype=torch.uint8, device=device))
    return out


def fill_deferred(
    images: Tensor | None, deferred: DeferredBatch, decode: Decoder, device: torch.device
) -> Tensor:
    """The batch's (B, 3, S, S) uint8 on ``device``: ``images`` (the workers' decoded samples,
    already there; None when every sample was deferred) with each deferred sample's place filled:
    its JPEG decoded, the box cropped, resized to S x S (bicubic, antialiased, rounded as torch
    rounds) and flipped, the whole batch at once. Boxes are whole pixels (RandomResizedCrop's)."""
    decoded = decode_each(deferred.file_list(), deferred.keys, decode, device)
    boxes, flips = deferred.boxes.numpy(), deferred.flips.numpy()
    filled = crop_resize_flip(decoded, boxes, flips, deferred.img_size)
    if images is None:  # every place, in order
        return filled
    places = packed_copy([deferred.places.numpy()], np.int64, device)[0]
    return images.index_copy_(0, places, filled)
