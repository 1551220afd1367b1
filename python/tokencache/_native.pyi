"""Type stubs for the native extension (rust/tokencache-py). Checked by `mypy.stubtest`."""

from typing import final

import numpy as np
from numpy.typing import ArrayLike, NDArray

__version__: str
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

class TokenCacheError(Exception):
    """Base class of every error tokencache raises."""

class InvalidTokenError(TokenCacheError, ValueError):
    """A token id is negative or does not fit in 32 bits."""

class ShapeError(TokenCacheError, ValueError):
    """An array has the wrong dtype, rank, or length (e.g. len(tokens) != len(slots))."""

class PageAlignmentError(TokenCacheError, ValueError):
    """Slots of one page are not one aligned run, or an operation would cut a shared page."""

class DuplicateSlotError(TokenCacheError, ValueError):
    """A KV slot given twice in one call, or (with strict_slots=True) a slot the tree
    already holds for another token."""

class DuplicateCursorError(TokenCacheError, ValueError):
    """The same cursor appears twice in one extend_many batch."""

class CursorBusyError(TokenCacheError, RuntimeError):
    """A cursor is in use by a call on another thread (an extend_many in progress)."""

class StaleHandleError(TokenCacheError, KeyError):
    """A node handle or cursor refers to a node that was evicted, truncated away or reset."""

class ForeignHandleError(TokenCacheError, ValueError):
    """A node handle or cursor belongs to another tree."""

class LockStateError(TokenCacheError, RuntimeError):
    """Unlocking a node that holds no lock, or using a released cursor."""

class InvalidArgumentError(TokenCacheError, ValueError):
    """Any other invalid argument (negative counts, unknown policy, bad offsets)."""

@final
class Node:
    """A generational handle to a tree node. It never keeps the node alive; it holds its tree,
    where ``key`` reads the node's tokens."""

    @property
    def id(self) -> int: ...
    @property
    def generation(self) -> int: ...
    @property
    def is_root(self) -> bool: ...
    def is_alive(self) -> bool: ...
    def lock_ref(self) -> int:
        """Locks and pins held on this node itself (not its subtree)."""
    @property
    def key(self) -> NDArray[np.int64]:
        """The token ids on the edge into this node (SGLang's ``TreeNode.key``): empty for a
        namespace root. A later split shortens the deeper node's key. StaleHandleError once
        the node is evicted, removed or reset."""
    def __eq__(self, other: object, /) -> bool: ...
    def __hash__(self) -> int: ...

@final
class MatchResult:
    @property
    def length(self) -> int: ...
    @property
    def slots(self) -> NDArray[np.int64]: ...
    @property
    def node(self) -> Node: ...

@final
class InsertResult:
    @property
    def prefix_len(self) -> int:
        """Tokens that were already cached: the caller frees its own slots for them."""
    @property
    def node(self) -> Node: ...

@final
class Dedup:
    """New slots a cursor did not keep because the tree already held those tokens.

    For every entry: `freed[i]` is the caller's slot to free, `slots[i]` is the tree's slot
    for sequence position `positions[i]` of request `request[i]` (0 for a single extend).
    """

    @property
    def request(self) -> NDArray[np.int64]: ...
    @property
    def positions(self) -> NDArray[np.int64]: ...
    @property
    def freed(self) -> NDArray[np.int64]: ...
    @property
    def slots(self) -> NDArray[np.int64]: ...
    def __len__(self) -> int: ...

@final
class KVEvent:
    @property
    def kind(self) -> str:
        """Either "stored", "removed" or "cleared"."""
    @property
    def page_hashes(self) -> list[int]:
        """Signed 64-bit page ids, as SGLang's KV events carry them."""
    @property
    def parent_hash(self) -> int | None: ...
    @property
    def page_digests(self) -> list[bytes]:
        """Full SHA-256 page digests (SGLang's chain: previous digest + little-endian u32 ids)."""
    @property
    def parent_digest(self) -> bytes | None:
        """The parent node's last page digest; None under a namespace root."""
    @property
    def token_ids(self) -> list[int]:
        """Tokens of the stored pages (empty for "removed")."""
    @property
    def namespace(self) -> str | None: ...

@final
class Cursor:
    """Where one request's sequence ends in the tree. Pins its path while alive.

    A cursor is used by one call at a time: while an extend_many on another thread holds it,
    every call on it raises CursorBusyError (it never blocks).
    """

    @property
    def length(self) -> int:
        """Tokens in the sequence, cached pages plus the uncached tail."""
    @property
    def cached_length(self) -> int:
        """Tokens held by the tree (page aligned)."""
    @property
    def node(self) -> Node: ...
    @property
    def namespace(self) -> str | None: ...
    @property
    def released(self) -> bool: ...
    def extend(self, tokens: ArrayLike, slots: ArrayLike) -> Dedup | None:
        """Append tokens with their KV slots in O(len(tokens)); returns the duplicates, if any.

        Raises DuplicateSlotError (changing nothing) if a slot occurs twice among `slots` and
        the cursor's uncached tail, or, with strict_slots=True, if the tree holds it for
        another token; PageAlignmentError for a misaligned page only with strict_pages=True.
        """
    def record_hits(self, since: int) -> None:
        """Count an LFU hit on every path node that ends past `since` (SGLang's inserted_len)."""
    def touch(self) -> None:
        """Mark the whole sequence used now (LRU) in O(1)."""
    def truncate(self, num_tokens: int) -> NDArray[np.int64]:
        """Drop the last num_tokens; returns the slots only this cursor held (caller frees)."""
    def release(self) -> NDArray[np.int64]:
        """Unpin; returns the uncached tail's slots (caller frees). The cursor is then dead."""
    def slots(self) -> NDArray[np.int64]:
        """KV slots of the whole sequence, root to tail."""
    def tokens(self) -> NDArray[np.int64]:
        """Token ids of the whole sequence, root to tail."""

@final
class RadixTree:
    """A radix KV-prefix tree (SGLang RadixCache semantics) with resumable cursors.

    Every refused call raises a TokenCacheError subclass and changes nothing. Two checks are
    opt-in, because they cost something on every call or constrain the allocator:

    - strict_pages (default False): each whole page of slots must be one run starting at a
      multiple of page_size, as a paged allocator hands them out; otherwise PageAlignmentError.
      By default any slots are accepted for a page and PageAlignmentError is raised only by
      Cursor.truncate into a shared page.
    - strict_slots (default False): a slot the tree already holds may only be given again for
      the very token it holds it for (a re-insert); otherwise DuplicateSlotError. The tree
      keeps a set of its slots for this (one hash-set entry per cached token). By default
      only a slot repeated within one call (insert, extend, or one extend_many batch with the
      cursors' uncached tails) is refused, in O(slots given).
    """

    def __new__(
        cls,
        page_size: int = 1,
        eviction_policy: str = "lru",
        enable_events: bool = False,
        strict_pages: bool = False,
        strict_slots: bool = False,
    ) -> RadixTree: ...
    @property
    def page_size(self) -> int: ...
    @property
    def eviction_policy(self) -> str: ...
    @property
    def root(self) -> Node: ...
    def match_prefix(self, tokens: ArrayLike, namespace: str | None = None) -> MatchResult: ...
    def cached_prefix_len(self, tokens: ArrayLike, namespace: str | None = None) -> int:
        """match_prefix's length, read only: no split, no access time, no slots copied."""
    def insert(
        self,
        tokens: ArrayLike,
        slots: ArrayLike,
        namespace: str | None = None,
        inserted_len: int = 0,
    ) -> InsertResult:
        """Cache tokens -> slots (a tail shorter than a page is ignored).

        Nodes within inserted_len (this caller's earlier insert) count no new LFU hit, like
        SGLang's InsertParams.inserted_len; it must lie in [0, len(tokens)]
        (InvalidArgumentError). A slot given twice raises DuplicateSlotError, as does one the
        tree holds for another token with strict_slots=True; a misaligned page raises
        PageAlignmentError only with strict_pages=True. A refused call changes nothing.
        """
    def lock(self, node: Node) -> int:
        """Protect node and its ancestors; returns how many tokens became protected."""
    def unlock(self, node: Node) -> int:
        """Undo one lock; returns how many tokens became evictable."""
    def pin(self, node: Node) -> None:
        """Lock-free lock: one atomic operation; sizes update at the next tree operation."""
    def unpin(self, node: Node) -> None:
        """Lock-free unlock."""
    def evict(self, num_tokens: int) -> NDArray[np.int64]:
        """Free at least num_tokens (if possible), whole unlocked leaves by policy order."""
    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def total_size(self) -> int: ...
    def node_count(self) -> int: ...
    def memory_bytes(self) -> int:
        """Heap bytes held by the tree (an accounting of capacities)."""
    def reset(self) -> NDArray[np.int64]:
        """Drop everything; returns every slot the tree held. Cursors and handles go stale."""
    def pretty_print(self) -> str: ...
    def all_slots(self) -> NDArray[np.int64]: ...
    def path_slots(self, node: Node) -> NDArray[np.int64]: ...
    def path_length(self, node: Node) -> int: ...
    def dfs_weight_order(self, nodes: list[Node]) -> list[int]:
        """SGLang's dfs-weight order of requests whose last nodes are `nodes` (indices)."""
    def take_events(self) -> list[KVEvent]: ...
    def set_event_seed(self, namespace: str | None, seed: bytes | None) -> None:
        """Chain a namespace's event digests from a 32-byte seed (SGLang seeds salted keys)."""
    def check_invariants(self) -> None:
        """Raise AssertionError describing the first broken invariant."""
    def cursor(self, namespace: str | None = None) -> Cursor:
        """An empty cursor at the namespace root."""
    def cursor_at(self, node: Node) -> Cursor:
        """A cursor at the end of node's path (after a match); pins it."""
    def extend_many(
        self,
        cursors: list[Cursor],
        offsets: ArrayLike,
        tokens: ArrayLike,
        slots: ArrayLike,
    ) -> Dedup:
        """Extend cursors[i] with tokens[offsets[i]:offsets[i+1]] in one native call.

        All checks run before any cursor moves, so a refused batch changes nothing: the same
        cursor twice raises DuplicateCursorError, a cursor in use on another thread
        CursorBusyError, a slot given twice anywhere in the batch DuplicateSlotError.
        """
