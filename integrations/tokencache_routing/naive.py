"""The naive dispatcher's KV handle: SGLang's RadixCache protocol around every hand-off.

A request that leaves a model is cached like a finished request (insert, free the duplicate
slots, unlock); when it comes back it is admitted as new (match from the root, lock, prefill the
rest). Between hand-offs it decodes on a private slot list, as SGLang's req_to_token does.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

import tokencache

from .kv import ModelSide


class NaiveKV:
    def __init__(self, side: ModelSide) -> None:
        self.side = side
        self.node: tokencache.Node | None = None
        self._slots = np.empty(0, dtype=np.int64)
        self._n = 0
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
        self._slots = np.empty(max(16, 2 * len(seq)), dtype=np.int64)
        self._slots[: m.length] = m.slots
        self._n = self._prefix_len = m.length

    @property
    def length(self) -> int:
        return self._n

    def slots(self) -> np.ndarray:
        return self._slots[: self._n]

    def _append(self, slots: np.ndarray) -> None:
        end = self._n + len(slots)
        if end > len(self._slots):
            grown = np.empty(2 * end, dtype=np.int64)
            grown[: self._n] = self._slots[: self._n]
            self._slots = grown
        self._slots[self._n : end] = slots
        self._n = end

    @staticmethod
    def commit_many(
        side: ModelSide,
        handles: Sequence[NaiveKV],
        offsets: np.ndarray,
        tokens: np.ndarray,
        slots: np.ndarray,
    ) -> None:
        for i, h in enumerate(handles):
            h._append(slots[offsets[i] : offsets[i + 1]])

    def park(self, seq: np.ndarray) -> None:
        """Leaving this model: cache the request as finished (SGLang cache_finished_req)."""
        self.release(seq)

    def release(self, seq: np.ndarray) -> None:
        if self.node is None:
            return
        tree = self.side.tree
        # The tree caches whole pages only (as SGLang's does): the partial last page's slots
        # are the request's own and go back with it.
        aligned = self._n - self._n % tree.page_size
        with self.side.bookkeeping("insert"):
            res = tree.insert(seq[:aligned], self._slots[:aligned])
        with self.side.bookkeeping("unlock"):
            tree.unlock(self.node)
        # Slots the tree already held for [prefix_len, res.prefix_len) are duplicates.
        self.side.free(self._slots[self._prefix_len : res.prefix_len].copy())
        self.side.free(self._slots[aligned : self._n].copy())
        self.node = None
        self._n = self._prefix_len = 0
