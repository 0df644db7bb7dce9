"""Write WebDataset tar shards (`key.jpg|png|webp` + `key.cls`), a sizes.json beside them and each
shard's member index (`NAME.tar.idx`, ``mpp.data.shard_index``) (docs/ARCHITECTURE.md §3.2)."""

from __future__ import annotations

import io
import json
import os
import random
import re
import tarfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError
from tqdm import tqdm

from . import shard_index
from .census import scan_shard
from .errors import DataError, SkipCounter
from .sources import SIZES_FILE, _write_json
from .transforms import sniff_format

ImageLike = bytes | str | os.PathLike | np.ndarray | Image.Image
Sample = tuple[ImageLike, int | None]
IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".npy"}
_EXT = {"jpeg": "jpg", "png": "png", "webp": "webp", "npy": "npy", "tiff": "tif"}
_KEPT = ("npy", "tiff")  # arrays and multi-band files: kept byte for byte, never re-encoded
_TAR_BLOCK, _TAR_END = 512, 10240  # header/padding unit; end-of-archive record, at most


def _image_files(folder: Path, recursive: bool) -> list[Path]:
    files = folder.rglob("*") if recursive else folder.iterdir()
    return sorted(p for p in files if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def from_image_folder(root: str | os.PathLike) -> tuple[list[Sample], list[str]]:
    """ImageNet-style `root/<class>/**/<image>` -> ([(path, label)], class_names); labels follow sorted names."""
    root = Path(root)
    class_names = sorted(d.name for d in root.iterdir() if d.is_dir())
    if not class_names:
        raise ValueError(
            f"{root}: no class sub-folders (use from_flat_folder for unlabelled images)"
        )
    samples = [
        (p, label)
        for label, name in enumerate(class_names)
        for p in _image_files(root / name, True)
    ]
    return samples, class_names


def from_flat_folder(root: str | os.PathLike) -> list[Sample]:
    """Every image under `root`, unlabelled: [(path, None)]."""
    return [(p, None) for p in _image_files(Path(root), True)]


def from_arrays(
    images: np.ndarray | Sequence[np.ndarray], labels: Sequence[int] | None = None
) -> list[Sample]:
    """Arrays (+ labels) -> samples: uint8 (N, H, W) or (N, H, W, 3) are PNG-encoded when
    written; any other channel count or dtype (uint16, float32) is kept exactly, as ``.npy``."""
    if labels is not None and len(labels) != len(images):
        raise ValueError(f"{len(images)} images but {len(labels)} labels")
    return [(images[i], None if labels is None else int(labels[i])) for i in range(len(images))]


class _OptionError(ValueError):
    """What ``ImageEncoding`` asks cannot be done to this kind of sample: the options' error, not
    the sample's (the writer stops on it rather than skipping every such sample)."""


def _png_able(array: np.ndarray) -> bool:
    """An array PIL writes to PNG losslessly as it is: uint8 grey or RGB."""
    return array.dtype == np.uint8 and (array.ndim == 2 or array.shape[-1] in (1, 3))


@dataclass(frozen=True)
class ImageEncoding:
    """What each image is stored as. Encoded input is kept byte-for-byte unless ``resize`` (the
    short side, re-encoding in the same format), ``max_side`` (images whose longer side exceeds
    it, shrunk to it: FFCV's max_resolution; 8-bit images only, arrays, TIFFs and 16-bit PNGs
    are kept as they are) or
    ``reencode`` ('jpeg' | 'png' | 'webp') asks; ``quality`` is JPEG's and WebP's when
    re-encoding. Arrays are PNG-encoded (lossless)."""

    resize: int | None = None
    reencode: str | None = None
    quality: int = 95
    max_side: int | None = None


def _new_size(img: Image.Image, e: ImageEncoding) -> tuple[int, int] | None:
    """The stored size of ``img`` under ``resize`` and ``max_side`` (8-bit RGB and grey images
    only: 16-bit, float and other modes are kept as they are); None: as it is."""
    w, h = img.size
    scale = e.resize / min(w, h) if e.resize is not None else 1.0
    eight_bit = img.mode in ("RGB", "L", "P", "RGBA", "LA", "CMYK", "YCbCr")
    if e.max_side is not None and eight_bit and max(w, h) * scale > e.max_side:
        scale = e.max_side / max(w, h)
    return None if scale == 1.0 else (max(1, round(w * scale)), max(1, round(h * scale)))


@dataclass(frozen=True)
class WriterOptions:
    """How ``write_shards`` deals the samples into shards: a shard closes at ``max_count``
    samples or before passing ``max_size`` bytes; ``seed`` shuffles the order first (None keeps
    it). ``overwrite`` replaces a prefix's existing shards (else they are an error); ``progress``
    shows a bar."""

    max_count: int = 10_000
    max_size: int = 1 << 30
    seed: int | None = 0
    overwrite: bool = False
    progress: bool = True


def encode_image(image: ImageLike, encoding: ImageEncoding | None = None) -> tuple[bytes, str]:
    """-> (bytes, extension). Encoded input is kept byte-for-byte unless ``encoding`` asks to
    resize/re-encode."""
    e = encoding or ImageEncoding()
    if isinstance(image, (str, os.PathLike)):
        image = Path(image).read_bytes()
    if isinstance(image, np.ndarray) and not _png_able(image):
        if e.resize is not None or e.reencode is not None:
            raise _OptionError(
                f"a {image.dtype} array of shape {image.shape} is kept as .npy as it is"
            )
        out = io.BytesIO()
        np.save(out, image, allow_pickle=False)
        return out.getvalue(), "npy"
    if isinstance(image, bytes):
        fmt = sniff_format(image)
        if fmt in _KEPT:
            if e.resize is not None or e.reencode is not None:
                raise _OptionError(f"{fmt} samples are kept as they are (no resize or re-encoding)")
            return image, _EXT[fmt]
        kept = fmt is not None and e.reencode in (None, fmt)
        if kept and e.resize is None and e.max_side is None:
            return image, _EXT[fmt]
        img = Image.open(io.BytesIO(image))  # the header: the size, no pixels yet
        if kept and _new_size(img, e) is None:
            return image, _EXT[fmt]
    elif isinstance(image, Image.Image):
        fmt, img = None, image
    else:
        a = np.asarray(image)
        fmt, img = None, Image.fromarray(a.squeeze(-1) if a.ndim == 3 and a.shape[-1] == 1 else a)
    target = e.reencode or fmt or "png"  # arrays and unknown formats: PNG, lossless
    if target not in _EXT:
        raise _OptionError(f"reencode must be one of {sorted(_EXT)}, got {target!r}")
    # arrays are the user's pixels: resized when asked, never by max_side
    size = _new_size(img, replace(e, max_side=None) if isinstance(image, np.ndarray) else e)
    if size is not None and img.format == "JPEG":
        img.draft("RGB", size)  # decode at 1/2..1/8 scale when that still covers `size`
    if img.mode not in ("RGB", "L"):
        img = img.convert("RGB")
    if size is not None:
        img = img.resize(size, Image.Resampling.BICUBIC)
    out = io.BytesIO()
    img.save(out, format=target.upper(), **({"quality": e.quality} if target != "png" else {}))
    return out.getvalue(), _EXT[target]


def shard_spec(out_dir: str | os.PathLike, prefix: str, num_shards: int) -> str:
    """The brace pattern naming `num_shards` shards: `out/prefix-{000000..000007}.tar`; one
    shard by its name, `out/prefix-000000.tar`."""
    last = f"{{000000..{num_shards - 1:06d}}}" if num_shards > 1 else "000000"
    return f"{out_dir}/{prefix}-{last}.tar"


def _add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0  # fixed metadata: same input, same bytes
    tar.addfile(info, io.BytesIO(data))


def _member_bytes(data: bytes) -> int:
    return _TAR_BLOCK + -(-len(data) // _TAR_BLOCK) * _TAR_BLOCK


def _update_sizes(
    out_dir: Path, prefix: str, counts: dict[str, int], class_names: list[str] | None
) -> None:
    # train and val may share a folder: keep the other prefixes' entries, replace ours
    path = out_dir / SIZES_FILE
    sizes = json.loads(path.read_text()) if path.exists() else {"shards": {}, "class_names": None}
    pattern = re.compile(rf"{re.escape(prefix)}-\d{{6}}\.tar")
    sizes["shards"] = {
        k: v for k, v in sizes["shards"].items() if not pattern.fullmatch(k)
    } | counts
    sizes["class_names"] = class_names if class_names is not None else sizes.get("class_names")
    _write_json(path, sizes)


def _clear_old_shards(out_dir: Path, prefix: str, overwrite: bool) -> None:
    """Make ``out_dir``; its old ``prefix-*.tar`` shards are an error unless ``overwrite``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    old = sorted(out_dir.glob(f"{prefix}-[0-9][0-9][0-9][0-9][0-9][0-9].tar"))
    if old and not overwrite:
        raise FileExistsError(
            f"{out_dir} already holds {prefix}-*.tar shards; pass WriterOptions(overwrite=True) "
            "(--overwrite on the command line) to replace them"
        )
    for path in old:
        path.unlink()
        path.with_name(path.name + shard_index.SUFFIX).unlink(missing_ok=True)


def _decode(data: bytes) -> None:
    """Decode every pixel of an encoded sample, as the loader will (raises what it would raise):
    PIL's ``load()``, not the header alone, which a JPEG header with garbage after it passes;
    arrays and TIFFs through numpy and tifffile (``mpp.data.transforms.decode``)."""
    kind = sniff_format(data)
    if kind == "npy":
        np.load(io.BytesIO(data), allow_pickle=False)
    elif kind == "tiff":
        import tifffile

        tifffile.imread(io.BytesIO(data))
    else:
        with Image.open(io.BytesIO(data)) as img:
            img.load()


def _decodes(image: ImageLike) -> bool:
    """Whether an encoded sample (a path or bytes; arrays and PIL images are pixels already)
    decodes whole: tells an unreadable input from an encoding that fails on a good one."""
    if not isinstance(image, (bytes, str, os.PathLike)):
        return True
    try:
        _decode(image if isinstance(image, bytes) else Path(image).read_bytes())
    except Exception:  # noqa: BLE001  PIL raises many types for corrupt data
        return False
    return True


def _stored(image: ImageLike, encoding: ImageEncoding | None) -> tuple[bytes, str]:
    """What ``write_shards`` stores for ``image``: ``encode_image``'s bytes, decoded whole when
    kept byte for byte (else nothing decodes them before the loader, every epoch). The decode
    is most of the cost: 1.5-3.5 ms for a 500 x 375 JPEG, 4-7x the rest of storing it."""
    raw = Path(image).read_bytes() if isinstance(image, (str, os.PathLike)) else image
    data, ext = encode_image(raw, encoding)
    if data is raw:
        _decode(data)
    return data, ext


def _skip_reason(exn: Exception) -> str:
    if isinstance(exn, UnidentifiedImageError):
        return "not an image PIL can read"  # its message names a BytesIO, not the file
    return f"cannot read or decode it ({exn!r})"


def write_shards(
    samples: Iterable[Sample],
    out_dir: str | os.PathLike,
    prefix: str = "data",
    *,
    options: WriterOptions | None = None,
    encoding: ImageEncoding | None = None,
    class_names: list[str] | None = None,
    errors: SkipCounter | None = None,
) -> list[str]:
    """Write `samples` [(image, label or None)] to `out_dir/prefix-000000.tar ...`; returns the shard paths.

    ``options`` (``WriterOptions``): when a shard closes, the shuffle seed, overwrite, progress.
    ``encoding`` (``ImageEncoding``): the bytes each image is stored as. ``class_names`` go to
    sizes.json. Every image is decoded whole (kept bytes too: a JPEG header with garbage after
    it opens, and fails only here); one that cannot be read or decoded is skipped, named (its
    path) in a warning (each one, unless ``errors``' log is rate-limited) and counted in
    ``errors.skipped`` (``SkipCounter``, as the loader counts bad samples); none readable at all
    is a ``DataError``. An image that decodes but cannot be
    encoded as ``encoding`` asks raises that error (the options' or this Pillow's, not the
    data's). On any error, no temporary file is left.
    """
    o = options or WriterOptions()
    out_dir = Path(out_dir)
    _clear_old_shards(out_dir, prefix, o.overwrite)
    # (input position, sample): a skipped in-memory sample is named by its position
    samples = list(enumerate(samples))
    if errors is None:  # every skipped image named, as the loader's rate-limited log would not
        errors = SkipCounter(max_consecutive=len(samples), log_first=len(samples))
    if o.seed is not None:
        random.Random(o.seed).shuffle(samples)  # cheap: paths and arrays move, bytes are read later
    paths: list[str] = []
    counts: dict[str, int] = {}
    tar, count, size = None, 0, 0

    def temporary() -> Path:
        return out_dir / f".{prefix}-{len(paths):06d}.tar.tmp"

    def close() -> None:
        tar.close()
        final = out_dir / f"{prefix}-{len(paths):06d}.tar"
        os.replace(temporary(), final)  # readers never see a half-written shard
        paths.append(str(final))
        counts[final.name] = count
        # the reader's own header pass (a seek per member): the offsets are the ones it reads
        shard_index.save(str(final), scan_shard(str(final)).index)

    written = 0
    try:
        for index, (position, (image, label)) in enumerate(
            tqdm(samples, desc=f"{prefix} shards", unit="img", disable=not o.progress)
        ):
            try:
                data, ext = _stored(image, encoding)
            except _OptionError:
                raise
            except Exception as exn:  # PIL raises many types for corrupt data
                name = image if isinstance(image, (str, os.PathLike)) else f"sample {position}"
                if _decodes(image):  # a good image the options or this PIL cannot store: stop
                    exn.add_note(
                        f"while encoding {name}, which decodes: the encoding failed, not the image"
                    )
                    raise
                errors.skip(f"skipping {name}: {_skip_reason(exn)}", decode=True)
                continue
            errors.sample_decoded()
            # the image first: a cut inside it loses one sample only; the key is the position
            # in the shuffled order (a skipped image leaves a gap)
            key = f"{index:09d}"
            members = [(f"{key}.{ext}", data)]
            if label is not None:
                members.append((f"{key}.cls", str(int(label)).encode()))
            needed = sum(_member_bytes(d) for _, d in members)
            if tar is not None and (count >= o.max_count or size + needed > o.max_size):
                close()
                tar = None
            if tar is None:
                tar = tarfile.open(temporary(), "w", format=tarfile.USTAR_FORMAT)
                count, size = 0, _TAR_END
            for name, blob in members:
                _add_member(tar, name, blob)
            count, size, written = count + 1, size + needed, written + 1
        if tar is not None:
            close()
            tar = None
    except BaseException:
        if tar is not None:
            try:
                tar.close()
            finally:
                temporary().unlink(missing_ok=True)
        raise
    if samples and not written:
        raise DataError(
            f"none of the {len(samples)} images could be read ({errors.skipped} skipped); "
            f"nothing written to {out_dir}"
        )
    _update_sizes(out_dir, prefix, counts, class_names)
    return paths
