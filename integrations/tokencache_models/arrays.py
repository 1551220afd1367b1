"""Array checks cheap enough for a forward's host path.

np.unique sorts and builds an inverse through a dozen Python-level calls: measured inside the
engine's step, where its code is cold, it cost ~40 us for a handful of entries. The arrays the
engine checks are usually sorted already (flat token positions, fresh slot ids), so one
vectorised comparison decides, and a sort only runs when that fails."""

from __future__ import annotations

import numpy as np


def has_duplicates(a: np.ndarray) -> bool:
    """Whether a 1-d array holds some value twice."""
    if len(a) < 2:
        return False
    if bool((a[1:] > a[:-1]).all()):  # strictly increasing: all distinct
        return False
    s = np.sort(a)
    return bool((s[1:] == s[:-1]).any())
