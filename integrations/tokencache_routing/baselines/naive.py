"""The naive dispatcher's KV handle: SGLang's RadixCache protocol around every hand-off.

A request that leaves a model is cached like a finished request (insert, free the duplicate
slots, unlock); when it comes back it is admitted as new (match from the root, lock, prefill the
rest). Between hand-offs it decodes on a private slot list, as SGLang's req_to_token does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import numpy as np

import tokencache

from ..core.kv import KVHandle, ModelSide, SlotRow


class NaiveKV(SlotRow):
    def __init__(self, side: ModelSide) -> None:
        super().__init__(side)
        self.node: tokencache.Node | None = None
        self._prefix_len = 0  # slots [0, prefix_len) belong to the tree (matched, locked)

    @property
    def attached(self) -> bool:
        return self.node is not None

    def attach(self, seq: np.ndarray) -> None:
        tree = self.side.tree
        with self.side.bookkeeping("match"):
            m = tree.match_prefix(seq[:-1])
        with self.side.bookkeeping("lock"):
            tree.lock(m.node)
        self.node = m.node
        self._take_row(m.slots)  # the whole matched prefix again, as SGLang's req_to_token
        self._prefix_len = m.length

    @staticmethod
    def commit_many(
        side: ModelSide,
        handles: Sequence[KVHandle],
        offsets: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
    ) -> None:
        SlotRow.committed_many(cast("Sequence[NaiveKV]", handles), offsets)

    def park(self, seq: np.ndarray) -> None:
        """Leaving this model: cache the request as finished (SGLang cache_finished_req)."""
        self.release(seq)

    def release(self, seq: np.ndarray) -> None:
        if self.node is None:
            return
        tree = self.side.tree
        # The tree caches whole pages only (as SGLang's does): the partial last page's slots
        # are the request's own and go back with it.
        row = self.slots()
        aligned = self._n - self._n % tree.page_size
        with self.side.bookkeeping("insert"):
            res = tree.insert(seq[:aligned], row[:aligned])
        with self.side.bookkeeping("unlock"):
            tree.unlock(self.node)
        # Slots the tree already held for [prefix_len, res.prefix_len) are duplicates.
        self.side.free(row[self._prefix_len : res.prefix_len].copy())
        self.side.free(row[aligned : self._n].copy())
        self.node = None
        self._prefix_len = 0
        self._drop_row()
