"""Command line: image folder (class sub-folders) or flat folder -> WebDataset shards + sizes.json.

mpp shards ~/imagenet/train data/in1k --prefix train --max-count 5000 --max-side 256
mpp shards my_images/ data/mine --prefix train        # class sub-folders -> labels
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from .errors import DataError, SkipCounter
from .writer import (
    ImageEncoding,
    WriterOptions,
    from_flat_folder,
    from_image_folder,
    shard_spec,
    write_shards,
)


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(prog="mpp shards", description=__doc__.splitlines()[0])
    parser.add_argument(
        "src", type=Path, help="image folder: <class>/<image> sub-folders, or flat with --flat"
    )
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--prefix", default="data", help="shards are named PREFIX-000000.tar ...")
    # the defaults are the library's (WriterOptions, ImageEncoding)
    parser.add_argument(
        "--max-count",
        type=int,
        default=WriterOptions.max_count,
        help="samples per shard, at most",
    )
    parser.add_argument(
        "--max-size-mb",
        type=float,
        default=WriterOptions.max_size >> 20,
        help="bytes per shard, at most (MiB)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=WriterOptions.seed,
        help="shuffle seed; -1 keeps the folder order",
    )
    parser.add_argument("--resize", type=int, default=None, help="re-encode with this short side")
    parser.add_argument(
        "--max-side",
        type=int,
        default=None,
        help="re-encode images whose longer side exceeds this to it (others kept as they are): "
        "a CPU worker crops 1.6x as many 256-px JPEGs a second as 500 x 375 ones",
    )
    parser.add_argument("--reencode", choices=["jpeg", "png", "webp"], default=None)
    parser.add_argument(
        "--quality",
        type=int,
        default=ImageEncoding.quality,
        help="JPEG/WebP quality when re-encoding",
    )
    parser.add_argument(
        "--flat", action="store_true", help="unlabelled: every image under SRC, no .cls"
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace existing PREFIX-*.tar shards"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    has_classes = any(p.is_dir() for p in args.src.iterdir())
    if args.flat or not has_classes:
        samples, class_names = from_flat_folder(args.src), None
    else:
        samples, class_names = from_image_folder(args.src)
    if not samples:
        parser.error(f"no images under {args.src}")
    # unreadable images: skipped, every one named (no rate limit: the summary points at them)
    errors = SkipCounter(max_consecutive=len(samples), log_first=len(samples))
    try:
        paths = write_shards(
            samples,
            args.out_dir,
            args.prefix,
            options=WriterOptions(
                max_count=args.max_count,
                max_size=int(args.max_size_mb * 2**20),
                seed=None if args.seed < 0 else args.seed,
                overwrite=args.overwrite,
                progress=not args.no_progress,
            ),
            encoding=ImageEncoding(
                resize=args.resize,
                reencode=args.reencode,
                quality=args.quality,
                max_side=args.max_side,
            ),
            class_names=class_names,
            errors=errors,
        )
    except DataError as exn:
        parser.error(str(exn))
    labels = f", {len(class_names)} classes" if class_names else ", unlabelled"
    skipped = f"; skipped {errors.skipped} unreadable (named above)" if errors.skipped else ""
    spec = shard_spec(args.out_dir, args.prefix, len(paths))
    print(f"wrote {len(samples) - errors.skipped} samples{labels} to {spec}{skipped}")
    return paths


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
