"""How the shared-prefix kernel runs: its tile, passes, splits and extra traffic.

Pure Python (no torch, no triton) so that the three places that need it agree: the runner
decides with it whether a forward takes the shared-prefix path (groups.paying_groups),
the Triton kernel takes its grid from it (kernels/shared_prefix_attention.py), and the routing
engine's GPU clock prices forwards with it (tokencache_routing/sim/clock.py).

Costs are counted in KV slots of the model's shape (one token's K and V in one layer): a
prefix is read once per block of query rows (a pass), and each split of the prefix writes a
partial (acc, max, sum in fp32 per query token and head) that the merge reads back. The path
pays when that is less than every row reading its prefix itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import ModelConfig

# The shortest common prefix considered at all (one K/V block); paying_groups decides the rest.
MIN_SHARED_PREFIX = 64
# Programs to aim for: one wave of a 132-SM GPU. A 128-row tile over 8 warps holds one block
# per SM (160 registers x 256 threads), so a second wave would only queue behind the first,
# while every split costs a partial per query row.
SPLIT_TARGET = 132
MAX_SPLITS = 32
# A host-known prefix (catch-ups, prefills) keeps each split at least this many BLOCK_N chunks.
MIN_SPLIT_CHUNKS = 4


def kv_block_slots(itemsize: int) -> int:
    """K/V slots per online-softmax step (BLOCK_N) of every Triton attention kernel, by the
    cache's bytes per element. fp32 caches take IEEE dots, which at 64-wide tiles spill on
    sm_90 (benches/gpu/compile_check.py: the varlen kernel ~9 KB of local memory per thread
    with triton 3.9, 16-17 KB with 3.6, where decode also needs 255 registers and 0.8 KB); at
    32, nothing with 3.9, 0.75 KB (varlen split-KV) with 3.6."""
    return 64 if itemsize <= 2 else 32


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


@dataclass(frozen=True)
class PrefixShape:
    """The attention shape the shared-prefix kernel's geometry and cost depend on."""

    group: int  # query heads per kv head
    kv_heads: int
    head_dim: int
    itemsize: int = 2  # bytes per K/V element in the cache (bf16: 2, the benchmarks' case)

    @classmethod
    def of(cls, config: ModelConfig, itemsize: int = 2) -> PrefixShape:
        group = config.num_attention_heads // config.num_key_value_heads
        return cls(group, config.num_key_value_heads, config.head_dim, itemsize)

    @property
    def rows(self) -> int:
        """Query rows (tokens x the GQA group padded to a power of two) per program: 128 over
        8 warps for 16-bit caches; 32 for fp32, whose IEEE dots spill larger tiles."""
        return max(128 if self.itemsize <= 2 else 32, 16, _next_pow2(self.group))

    @property
    def block_n(self) -> int:
        return kv_block_slots(self.itemsize)

    @property
    def tokens_per_block(self) -> int:
        return self.rows // _next_pow2(self.group)

    def passes(self, num_tokens: int) -> int:
        """How many times the kernel reads the prefix: once per block of query tokens."""
        return -(-num_tokens // self.tokens_per_block)

    def splits(self, num_tokens: int, prefix_len: int | None = None) -> int:
        """Split columns over the prefix. prefix_len None: from the grid only (decode, whose
        CUDA graphs replay any prefix length); a host-known P also keeps splits long enough."""
        programs = max(1, self.passes(num_tokens) * self.kv_heads)
        splits = min(-(-SPLIT_TARGET // programs), MAX_SPLITS)
        if prefix_len is not None:
            splits = max(1, min(splits, prefix_len // (MIN_SPLIT_CHUNKS * self.block_n)))
        return splits

    def overhead_slots(self, num_tokens: int, prefix_len: int | None = None) -> int:
        """The partials' traffic (written, then read by the merge) in KV slots of this shape."""
        heads = self.group * self.kv_heads
        partial = 2 * num_tokens * heads * self.splits(num_tokens, prefix_len)
        partial *= (self.head_dim + 2) * 4
        slot = 2 * self.kv_heads * self.head_dim * self.itemsize
        return -(-partial // slot)
