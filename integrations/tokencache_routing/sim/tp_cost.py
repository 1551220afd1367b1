"""The GPU clock's price of a tensor-parallel forward: a model split over `tp` GPUs.

Each rank reads 1/tp of the weights and of the KV (its KV heads; with fewer KV heads than ranks, a
copy of one: 1/num_kv_heads) and does 1/tp of the FLOPs, the roofline of clock.Roofline on that
share; then the collectives tokencache_models.parallel.tp_layers issues, which sit between a layer's
GEMMs and so are not overlapped: two all-reduces per layer (after attention, after the MLP) and one
after the embedding, each of new_tokens x hidden elements, plus one all-gather of the logits (batch
x vocab). An NCCL ring all-reduce of B bytes moves 2 (tp - 1) / tp x B through each GPU's link, an
all-gather (tp - 1) / tp x B; each collective also pays a fixed latency.

Figures: NVLINK_BYTES_S is half the 900 GB/s NVLink bandwidth NVIDIA publishes for the H200
(SXM; https://www.nvidia.com/en-us/data-center/h200/, "NVLink: 900GB/s"), which counts both
directions: a ring sends and receives at once, 450 GB/s each way. COLLECTIVE_LATENCY_S is an
assumption (no published figure is used): a small all-reduce within one NVLink node costing ~10
microseconds, the order nccl-tests show for small messages. Neither has been measured here.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokencache_models import PRESETS
from tokencache_models.parallel.tp_layers import check_divisible, kv_heads_per_rank

from .clock import ForwardCost, GpuClock, Roofline, kv_bytes_per_token, param_count

NVLINK_BYTES_S = 450e9
COLLECTIVE_LATENCY_S = 10e-6


@dataclass(frozen=True)
class TPRoofline(Roofline):
    """Roofline of one rank's share (weight_bytes, kv_bytes_per_token and flops_per_token are
    per rank, so ForwardCost.floor stays a lower bound), plus the collectives."""

    tp: int = 1
    layers: int = 0
    hidden: int = 0
    vocab: int = 0
    elem_bytes: int = 2  # bf16 activations and logits before the fp32 cast
    link_bandwidth: float = NVLINK_BYTES_S
    latency: float = COLLECTIVE_LATENCY_S

    @classmethod
    def of_tp(cls, name: str, tp: int) -> TPRoofline:
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        cfg = PRESETS[name]
        try:
            check_divisible(cfg, tp)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from None
        params = param_count(cfg)
        # A rank's KV: its share of the heads, or a copy of one when there are fewer than tp
        # (replicated: tensor parallelism past the KV heads saves no KV traffic).
        kv_share = kv_heads_per_rank(cfg.num_key_value_heads, tp) / cfg.num_key_value_heads
        return cls(
            weight_bytes=2.0 * params / tp,
            kv_bytes_per_token=kv_bytes_per_token(cfg) * kv_share,
            flops_per_token=2.0 * params / tp,
            tp=tp,
            layers=cfg.num_hidden_layers,
            hidden=cfg.hidden_size,
            vocab=cfg.vocab_size,
        )

    def all_reduce_s(self, nbytes: float) -> float:
        if self.tp == 1:
            return 0.0
        return self.latency + 2 * (self.tp - 1) / self.tp * nbytes / self.link_bandwidth

    def all_gather_s(self, nbytes: float) -> float:
        """nbytes: the gathered result's size."""
        if self.tp == 1:
            return 0.0
        return self.latency + (self.tp - 1) / self.tp * nbytes / self.link_bandwidth

    def collectives_s(self, batch: float, new_tokens: float) -> float:
        reduces = 2 * self.layers + 1  # per layer after attention and the MLP; the embedding
        act = new_tokens * self.hidden * self.elem_bytes
        return reduces * self.all_reduce_s(act) + self.all_gather_s(
            batch * self.vocab * self.elem_bytes
        )

    def __call__(self, batch: float, new_tokens: float, kv_tokens: float) -> float:
        return super().__call__(batch, new_tokens, kv_tokens) + self.collectives_s(
            batch, new_tokens
        )


def tp_forward_cost(name: str, tp: int) -> ForwardCost:
    roof = TPRoofline.of_tp(name, tp)
    return ForwardCost(name, roof, roof)


# What the clock's description says of the collectives' price (the figures and their source).
SOURCE = (
    "all-reduce/all-gather at 450 GB/s each way: NVIDIA's published H200 NVLink 900 GB/s "
    "(nvidia.com/en-us/data-center/h200); 10 us a collective, assumed"
)


def tp_clock(
    small: str,
    large: str,
    large_tp: int,
    shared_prefix: bool | None = None,
    small_tp: int = 1,
) -> GpuClock:
    """The "h200-roofline" clock with the large model on large_tp GPUs (the small one on a GPU
    of its own, or on small_tp: the "large alone" bound prices the large model as both);
    tp 1 is that clock unchanged."""
    clock = GpuClock(small, large, "h200-roofline", shared_prefix)
    costs = list(clock.costs)
    for kind, (name, tp) in enumerate(((small, small_tp), (large, large_tp))):
        if tp > 1:
            costs[kind] = tp_forward_cost(name, tp)
    clock.costs = (costs[0], costs[1])
    if large_tp > 1 or small_tp > 1:
        tps = f"small tp={small_tp}, " if small_tp > 1 else ""
        clock.profile = f"h200-roofline, {tps}large tp={large_tp}; {SOURCE}"
    return clock
