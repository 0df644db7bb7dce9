"""WebDataset shards in, uint8 batches out: ``write_shards`` writes them, ``make_train_loader`` /
``make_eval_loader`` stream them (docs/ARCHITECTURE.md §3, §5.4)."""

from .digits import digits_shards
from .errors import DataError, SkipCounter
from .loader import Loader, StreamConfig, make_eval_loader, make_train_loader
from .sources import expand_shards, read_sizes
from .writer import (
    ImageEncoding,
    WriterOptions,
    from_arrays,
    from_flat_folder,
    from_image_folder,
    shard_spec,
    write_shards,
)

__all__ = [
    "DataError",
    "ImageEncoding",
    "Loader",
    "SkipCounter",
    "StreamConfig",
    "WriterOptions",
    "digits_shards",
    "expand_shards",
    "from_arrays",
    "from_flat_folder",
    "from_image_folder",
    "make_eval_loader",
    "make_train_loader",
    "read_sizes",
    "shard_spec",
    "write_shards",
]
