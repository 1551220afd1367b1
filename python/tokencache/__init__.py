"""tokencache: a radix KV-prefix cache with resumable request cursors and lock-free pinning.

The tree maps token-id prefixes to KV-cache slot indices with SGLang ``RadixCache`` semantics.
A :class:`Cursor` keeps a request's place in it, so a request that pauses (for instance while a
larger model writes one token) resumes and appends in O(new tokens), never re-walking its
context from the root.

    >>> import numpy as np, tokencache
    >>> tree = tokencache.RadixTree(page_size=1)
    >>> cur = tree.cursor()
    >>> cur.extend(np.array([5, 6, 7]), np.array([0, 1, 2]))
    >>> tree.match_prefix([5, 6, 9]).length
    2

Every bad input raises a :class:`TokenCacheError` subclass and changes nothing. Two checks are
opt-in (``RadixTree(strict_pages=..., strict_slots=...)``, both False by default):
``PageAlignmentError`` for a page whose slots are not one aligned run fires only with
``strict_pages=True``; ``DuplicateSlotError`` for a slot the tree already holds for another
token fires only with ``strict_slots=True``. A slot repeated within one call is always refused.
"""

from tokencache._native import (
    Cursor,
    CursorBusyError,
    Dedup,
    DuplicateCursorError,
    DuplicateSlotError,
    ForeignHandleError,
    InsertResult,
    InvalidArgumentError,
    InvalidTokenError,
    KVEvent,
    LockStateError,
    MatchResult,
    Node,
    PageAlignmentError,
    RadixTree,
    ShapeError,
    StaleHandleError,
    TokenCacheError,
    __version__,
)

__all__ = [
    "Cursor",
    "CursorBusyError",
    "Dedup",
    "DuplicateCursorError",
    "DuplicateSlotError",
    "ForeignHandleError",
    "InsertResult",
    "InvalidArgumentError",
    "InvalidTokenError",
    "KVEvent",
    "LockStateError",
    "MatchResult",
    "Node",
    "PageAlignmentError",
    "RadixTree",
    "ShapeError",
    "StaleHandleError",
    "TokenCacheError",
    "__version__",
]
