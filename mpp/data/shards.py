"""Command line: image folder (class sub-folders) or flat folder -> WebDataset shards + sizes.json
(and each shard's member index); or --index: the member index of shards any tool wrote.

mpp shards ~/imagenet/train data/in1k --prefix train --max-count 5000 --max-side 256
mpp shards my_images/ data/mine --prefix train        # class sub-folders -> labels
mpp shards --index 's3://bucket/train/'               # NAME.tar.idx beside each shard
mpp shards --index 'https://host/train-{000..127}.tar' --run-dir runs/x   # a read-only place
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from . import shard_index
from .census import census
from .errors import DataError, SkipCounter
from .sources import expand_shards
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
        "src",
        type=Path,
        nargs="?",
        help="image folder: <class>/<image> sub-folders, or flat with --flat",
    )
    parser.add_argument("out_dir", type=Path, nargs="?")
    parser.add_argument(
        "--index",
        metavar="SHARDS",
        help="instead: index these shards (any writer's, local or remote: a pattern, list or "
        "folder), so that a training stream reads only its own samples' bytes; NAME.tar.idx "
        "beside each shard, or in --run-dir",
    )
    parser.add_argument(
        "--run-dir",
        type=Path,
        help="with --index: the run that will read the shards, whose shard_index/ keeps the "
        "indexes their folder cannot (a read-only bucket, http)",
    )
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
    if args.index:
        return index_shards(args.index, args.run_dir, parser)
    if args.src is None or args.out_dir is None:
        parser.error("SRC and OUT_DIR are needed (or --index SHARDS)")
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


def index_shards(spec: str, run_dir: Path | None, parser: argparse.ArgumentParser) -> list[str]:
    """``--index``: the census's header pass over the shards without an index; the indexed shards."""
    shards = expand_shards(spec)
    counted = census(shards, run_dir=run_dir, index=True)
    if counted.index_to_run and run_dir is None:
        shown = ", ".join(list(counted.index_to_run)[:3])
        parser.error(f"cannot write beside {shown}: pass --run-dir RUN, the run that reads them")
    if run_dir is not None:
        counted.write_run_cache(run_dir)
    indexed = shard_index.present(shards, shard_index.run_index_dir(run_dir))
    where = f" ({shard_index.run_index_dir(run_dir)} for those beside which it cannot write)"
    print(f"{len(indexed)} of {len(shards)} shards indexed{where if run_dir else ''}")
    if len(indexed) < len(shards):
        left = [s for s in shards if s not in indexed]
        print(
            f"not indexed (compressed, or ending early: read from their start): {', '.join(left)}"
        )
    return sorted(indexed)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
