"""WebDataset shards in, uint8 batches out (DESIGN.md §3, §6).

Write shards with `write_shards` (or `python -m mpp.data.shards`), stream them with
`make_train_loader` / `make_eval_loader`, normalise on the device with `normalize`.
"""

from .digits import digits_shards
from .errors import DataError, SkipCounter
from .loader import Loader, make_eval_loader, make_train_loader
from .sources import count_samples, expand_shards, read_sizes
from .transforms import IMAGENET_MEAN, IMAGENET_STD, normalize
from .writer import from_arrays, from_flat_folder, from_image_folder, shard_spec, write_shards

__all__ = [
    "DataError",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Loader",
    "SkipCounter",
    "count_samples",
    "digits_shards",
    "expand_shards",
    "from_arrays",
    "from_flat_folder",
    "from_image_folder",
    "make_eval_loader",
    "make_train_loader",
    "normalize",
    "read_sizes",
    "shard_spec",
    "write_shards",
]
