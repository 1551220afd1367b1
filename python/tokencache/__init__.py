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
"""

from tokencache._native import (
    Cursor,
    Dedup,
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
    "Dedup",
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
