"""The held-out split: conversations the trainer never trains on, so acceptance length is measured on unseen data.

One rule shared by the training data source (which skips these) and the evaluator (which reads only these):
a seeded choice of ``count`` conversation indices in file order, independent of batch size and bucketing.
"""

from __future__ import annotations

import random

HOLDOUT_SEED_SALT = 0x5EED_E7A1


def heldout_indices(total: int, count: int, seed: int) -> frozenset[int]:
    """``count`` indices in ``range(total)`` (at most ``total - 1``: one conversation always stays for training)."""
    if total <= 0 or count <= 0:
        return frozenset()
    k = min(count, total - 1)
    return frozenset(random.Random(seed ^ HOLDOUT_SEED_SALT).sample(range(total), k))
