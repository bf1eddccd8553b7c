"""The paper's shard split (App. "Experimental Details"), through flwr-datasets' ShardPartitioner.

The training set is sorted by label and cut into ``5n`` equal shards; each
client gets 5 shards chosen uniformly at random without replacement, so at
most 5 classes. flwr-datasets' `ShardPartitioner`
with ``num_shards_per_partition=5`` does exactly this (a stable sort by label,
shards of ``floor(N / 5n)`` consecutive examples, a seeded permutation of the
shards); ``tests/test_data.py`` (``test_shard_split_matches_the_paper``) checks it against a plain numpy version
of the paper's procedure, index for index.

When ``N`` is not a multiple of ``5n`` the shard size is ``floor(N / 5n)`` and
the examples of the shards that no client gets are left out; this is logged.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np

__all__ = ["SHARDS_PER_CLIENT", "paper_shard_partition"]

logger = logging.getLogger(__name__)

#: Shards per client (paper: 5, so at most 5 labels per client).
SHARDS_PER_CLIENT = 5


def paper_shard_partition(labels: np.ndarray, num_clients: int, seed: int) -> np.ndarray:
    """Client ``i``'s training-example indices are row ``i`` of the returned ``(n, m)`` array.

    Parameters
    ----------
    labels:
        Training labels, one per example.
    num_clients:
        ``n``; the split uses ``5n`` shards of ``floor(N / 5n)`` examples.
    seed:
        Seeds the assignment of shards to clients (deterministic).

    Raises
    ------
    ValueError
        If there are fewer than ``5n`` training examples (a shard would be empty).
    """
    from datasets import Dataset, disable_progress_bars
    from flwr_datasets.partitioner import ShardPartitioner

    labels = np.asarray(labels)
    num_shards = SHARDS_PER_CLIENT * num_clients
    if len(labels) < num_shards:
        raise ValueError(
            f"num-clients = {num_clients} needs at least 5 * {num_clients} = {num_shards} training examples "
            f"(5 shards per client), but the dataset has {len(labels)}"
        )
    disable_progress_bars()
    partitioner = ShardPartitioner(
        num_partitions=num_clients,
        partition_by="label",
        num_shards_per_partition=SHARDS_PER_CLIENT,
        shuffle=False,
        seed=seed,
    )
    partitioner.dataset = Dataset.from_dict({"label": labels.astype(np.int64), "index": np.arange(len(labels))})
    with warnings.catch_warnings():  # pyarrow's deprecation notice inside datasets' sort
        warnings.simplefilter("ignore", FutureWarning)
        rows = [np.asarray(partitioner.load_partition(i)["index"], dtype=np.int64) for i in range(num_clients)]
    out = np.stack(rows)
    unused = len(labels) - out.size
    if unused:
        logger.warning(
            "shard split: %d of %d training examples are in no client's shards (shard size %d = floor(%d / %d)); "
            "choose num-clients so that 5 * num-clients divides %d to use them all",
            unused,
            len(labels),
            out.shape[1] // SHARDS_PER_CLIENT,
            len(labels),
            num_shards,
            len(labels),
        )
    return out
