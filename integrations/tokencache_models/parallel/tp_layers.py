"""Tensor parallelism over torch.distributed: the rank group and the sharded layers
(sharding.py cuts a model's shard for one rank out of them).

Megatron's split: q/k/v, gate and up are column-parallel (each rank holds a slice of the output
features: its heads, its part of the MLP), o_proj and down are row-parallel (a slice of the
input features, partial sums all-reduced), so a decoder layer costs one all-reduce after
attention and one after the MLP. The embedding and the LM head are split by vocabulary rows:
the embedding's ranks each look up the ids they hold (zeros elsewhere) and all-reduce, the
head's ranks each compute their rows' logits and all-gather them. Norms are replicated.

Each rank's KV pool holds its own KV heads (`shard_config`), or, with fewer KV heads than
ranks, a copy of the one KV head its query heads read (`kv_head_of`: world / num_kv_heads
ranks hold each); slot ids mean the same on every rank, so the radix tree, the cursors and the
slot table stay with the engine's rank.

Nothing here reads device memory back on the host: the collectives are plain c10d calls on
tensors of host-known shapes, which NCCL captures in CUDA graphs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..config import ModelConfig

if TYPE_CHECKING:
    pass

# fetch(name, dim, start, stop): the checkpoint tensor `name`, sliced [start, stop) along dim
# (dim None: the whole tensor). A state dict or a safetensors file's get_slice behind it.
Fetch = Callable[[str, "int | None", int, int], torch.Tensor]


@dataclass
class TPGroup:
    """This process's place in a tensor-parallel group. `group` carries the forward's
    collectives (NCCL on CUDA, gloo on CPU); world 1 issues none."""

    rank: int
    world: int
    group: Any = None  # a torch.distributed ProcessGroup (None: the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[world * n, ...]: every rank's x stacked in rank order (one collective)."""
        if self.world == 1:
            return x
        out = x.new_empty((self.world * x.shape[0], *x.shape[1:]))
        # all_gather_single: torch 2.13's name for all_gather_into_tensor (now deprecated).
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(out, x.contiguous(), group=self.group)
        return out


def kv_heads_per_rank(num_kv_heads: int, world: int) -> int:
    """KV heads one rank holds: its share, or 1 when there are fewer KV heads than ranks (each
    rank then holds a copy of the one KV head its query heads read: kv_head_of)."""
    return num_kv_heads // world if num_kv_heads >= world else 1


def kv_head_of(rank: int, num_kv_heads: int, world: int) -> int:
    """The first KV head of rank's slice. With fewer KV heads than ranks, world / num_kv_heads
    consecutive ranks share (replicate) one: rank r's query heads [r * q, (r + 1) * q) all
    belong to KV head r // (world / num_kv_heads)."""
    if num_kv_heads >= world:
        return rank * (num_kv_heads // world)
    return rank // (world // num_kv_heads)


def check_divisible(config: ModelConfig, world: int) -> None:
    """Heads and the MLP must split evenly; KV heads must split evenly, or, fewer than the
    ranks, divide them (each replicated on world / num_key_value_heads ranks)."""
    for name in ("num_attention_heads", "intermediate_size"):
        value = getattr(config, name)
        if value % world:
            raise ValueError(f"tensor parallelism {world}: {name}={value} does not split evenly")
    kv = config.num_key_value_heads
    if (kv >= world and kv % world) or (kv < world and world % kv):
        raise ValueError(
            f"tensor parallelism {world}: num_key_value_heads={kv} neither splits evenly nor "
            f"divides {world} (for replication); use a tensor-parallel size that divides or is "
            f"a multiple of {kv}"
        )


def shard_config(config: ModelConfig, world: int) -> ModelConfig:
    """The shapes one rank computes: its heads, KV heads (kv_heads_per_rank: replicated when
    fewer than the ranks) and MLP slice (vocab and hidden whole). Its KV pool and the
    attention kernels' shapes come from it."""
    check_divisible(config, world)
    if world == 1:
        return config
    return replace(
        config,
        num_attention_heads=config.num_attention_heads // world,
        num_key_value_heads=kv_heads_per_rank(config.num_key_value_heads, world),
        intermediate_size=config.intermediate_size // world,
    )


class ColumnParallelLinear(nn.Linear):
    """A slice of the output features; no communication (its consumer is rank-local)."""


class RowParallelLinear(nn.Linear):
    """A slice of the input features: each rank's partial product, summed by one all-reduce
    (in place on the GEMM's output, so a CUDA graph captures it over its own buffer)."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(F.linear(x, self.weight))


def vocab_shard(vocab: int, rank: int, world: int) -> tuple[int, int, int]:
    """(start, stop, rows): rank's vocabulary rows [start, stop), its shard padded to rows =
    ceil(vocab / world) (the padding rows' logits are dropped after the gather)."""
    rows = -(-vocab // world)
    start = min(vocab, rank * rows)
    return start, min(vocab, start + rows), rows


class VocabParallelEmbedding(nn.Module):
    """Rows [start, stop) of the embedding: ids elsewhere look up zeros; one all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int, stop: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.stop, self.tp = start, stop, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.stop - self.start)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill(outside[:, None], 0.0))


class VocabParallelLMHead(nn.Module):
    """Rows of the LM head (padded to equal shards; tied: the embedding's own parameter); each
    rank's logits all-gathered and put back in vocabulary order."""

    def __init__(self, weight: torch.Tensor | nn.Parameter, vocab: int, tp: TPGroup) -> None:
        super().__init__()
        self.weight = weight if isinstance(weight, nn.Parameter) else nn.Parameter(weight)
        self.weight.requires_grad_(False)
        self.vocab, self.tp = vocab, tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        local = F.linear(h, self.weight)  # [B, rows]
        if self.tp.world == 1:
            return local[:, : self.vocab]
        b, rows = local.shape
        full = self.tp.all_gather_rows(local)  # [world * B, rows], rank-major
        full = full.view(self.tp.world, b, rows).transpose(0, 1).reshape(b, -1)
        return full[:, : self.vocab]
