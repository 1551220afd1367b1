"""Engine clocks: what one forward costs on the engine's clock.

A CPU running tiny models has the wrong cost shape for a GPU (its step costs in proportion to
the batch; a GPU decode step costs about the same at batch 1 and 32), so schedules are judged
on a GPU cost model: `GpuClock` prices a forward of (batch, new tokens, KV tokens read) at the
shapes of real models, fitted to GPU measurements kept in data/*.json (refit whenever
benches/gpu records new ones: `GpuClock.fit(path, ...)`).

kv_tokens is the KV slots the modelled runner reads. A runner with shared-prefix ("cascade")
attention (`shared_prefix=True`) finds, from a forward's slot lists, groups of rows whose slot
lists start alike (tokencache_models.find_prefix_groups: rows on one system prompt share its KV
slots, so a batch over K prompts holds up to K groups, at most MAX_PREFIX_GROUPS), keeps the
groups that pay (tokencache_models.paying_groups: the runner's own rule, all-or-nothing against
the split partials every query token then writes and merges) and reads each kept group's P
leading slots once per block of its query rows instead of once per row. `prefix_of` gives that
as a PrefixRead: the slots the rows skip (sum of rows*P) and what the prefix path reads instead
(P*passes per group + the partials; tokencache_models.prefix_traffic, bf16 caches); a forward
then reads sum(kv_lens) - skipped + read, less than sum(kv_lens) whenever a group is kept (long
catch-ups, prefills and short prefixes read per row). Without it every row reads its whole slot
list, sum(kv_lens). `describe()` names the mode.

Profiles:
- "h200-2026-12-04" (default): least-squares fit of cost = a + b*batch + c*new_tokens +
  d*kv_tokens to decode_step.py's rows of one H200 (data/h200-2026-12-04.json, the file that
  run wrote, kept verbatim; per shape the fastest path: decode from CUDA graphs, 2.3-10 ms;
  multi-token forwards eager and host-bound, ~15-20 ms at any size). That runner reads a
  shared prefix once (shared_prefix True). Its engine overhead (data/h200-2026-12-04.engine.json,
  written by tools/clock_check.py --refit from the same run's serving rows) adds what a
  forward costs inside the engine beyond the isolated forward: the host work around a small
  step, and a catch-up's own preparation and synchronisation (28-34 ms in the engine against
  ~20 ms isolated). `engine_overhead=False` prices the isolated forwards alone.
- "h200-2026-11-30": the same fit to the runner of that day (host-bound: ~22-28 ms a step at
  any batch; multi-token catch-ups far above their work). That runner read each row's KV
  itself: shared_prefix False (as for clocks fitted with GpuClock.fit, unless asked).
- "h200-roofline": no measurement: weights + KV read once at the device's bandwidth, or the
  FLOPs at its peak, whichever is larger, times 1.5 (the runner's target). A model of
  the runner being built, which reads a shared prefix once (shared_prefix True by default): a
  runner that does not exist yet, labelled as such wherever it is used.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tokencache_models import (
    MIN_SHARED_PREFIX,
    PRESETS,
    HostBatch,
    ModelConfig,
    PrefixGroup,
    PrefixShape,
    find_prefix_groups,
    paying_groups,
    prefix_traffic,
)

from ..core.prefix import NO_PREFIX, PrefixRead

DATA = Path(__file__).resolve().parents[1] / "data"
DEFAULT_PROFILE = "h200-2026-12-04"
MEASURED_PROFILES = (DEFAULT_PROFILE, "h200-2026-11-30")
PROFILES = (*MEASURED_PROFILES, "h200-roofline")
ROOFLINE_SLACK = 1.5


def param_count(c: ModelConfig) -> int:
    attn = c.hidden_size * c.head_dim * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    mlp = 3 * c.hidden_size * c.intermediate_size
    embed = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    return c.num_hidden_layers * (attn + mlp) + embed


def kv_bytes_per_token(c: ModelConfig, bytes_per_elem: int = 2) -> int:
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * bytes_per_elem


def _np64(x: Any) -> np.ndarray:
    """A numpy int64 view of a numpy array or a CPU tensor (not copied when already int64)."""
    return np.asarray(x.numpy() if hasattr(x, "numpy") else x, dtype=np.int64)


@dataclass(frozen=True)
class Linear:
    """Seconds = a + b*batch + c*new_tokens + d*kv_tokens."""

    a: float
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0

    def __call__(self, batch: float, new_tokens: float, kv_tokens: float) -> float:
        return self.a + self.b * batch + self.c * new_tokens + self.d * kv_tokens

    def floor(self, tokens: int, decode: bool) -> float:
        """The least a forward of `tokens` new tokens and no KV costs (coefficients >= 0): a
        decode forward has batch >= new tokens, any forward batch >= 1."""
        if decode:
            return self.a + (self.b + self.c) * tokens
        return self.a + self.b + self.c * tokens


@dataclass(frozen=True)
class Roofline:
    """Weights and the KV read once at the bandwidth, or the FLOPs at the peak, whichever is
    larger, times ROOFLINE_SLACK."""

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_token: float
    bandwidth: float = 4.8e12
    peak_flops: float = 989e12

    @classmethod
    def of(cls, name: str) -> Roofline:
        cfg = PRESETS[name]
        params = param_count(cfg)
        return cls(2.0 * params, float(kv_bytes_per_token(cfg)), 2.0 * params)

    def __call__(self, batch: float, new_tokens: float, kv_tokens: float) -> float:
        mem = (self.weight_bytes + self.kv_bytes_per_token * kv_tokens) / self.bandwidth
        return ROOFLINE_SLACK * max(mem, self.flops_per_token * new_tokens / self.peak_flops)


@dataclass(frozen=True)
class ForwardCost:
    """One model's forward cost. Decode (one new token per request) and multi-token forwards
    (prefills, catch-ups) cost differently on a real runner, so each has its own fit; a
    multi-token forward without measurements costs the decode fit or the roofline, whichever
    is larger. decode_overhead / multi_overhead: seconds the engine adds to each such forward
    beyond the isolated forward (EngineOverhead)."""

    model: str
    decode: Linear | Roofline
    multi: Linear | Roofline | None = None
    decode_overhead: float = 0.0
    multi_overhead: float = 0.0

    def __call__(self, batch: float, new_tokens: float, kv_tokens: float) -> float:
        """Seconds of one forward (a mean shape, in fractional rows and tokens, prices the
        mean forward: the fits are linear in each)."""
        if batch == 0:
            return 0.0
        if new_tokens <= batch:
            return self.decode(batch, new_tokens, kv_tokens) + self.decode_overhead
        if self.multi is not None:
            return self.multi(batch, new_tokens, kv_tokens) + self.multi_overhead
        roof = Roofline.of(self.model)(batch, new_tokens, kv_tokens)
        return max(self.decode(batch, new_tokens, kv_tokens), roof) + self.multi_overhead

    def isolated(self) -> ForwardCost:
        """The same fits without the engine's overhead."""
        return ForwardCost(self.model, self.decode, self.multi)

    def floor(self, total_tokens: int, total_kv_tokens: int = 0) -> float:
        """No set of forwards writing total_tokens new tokens and reading total_kv_tokens KV
        slots in all costs less.

        Linear fits: each forward costs at least g(its tokens) plus the smaller KV coefficient
        times its KV, g the smaller of the decode and the multi-token fit's least cost
        (Linear.floor); g is concave with g(0) >= 0, so subadditive, and the forwards cost at
        least g(total) + d * total KV. Without a multi-token fit a multi-token forward costs at
        least the decode fit. Rooflines: each forward costs at least its bytes and at least its
        FLOPs, so all of them at least one weight read plus every KV byte, and every token's
        FLOPs."""
        if total_tokens <= 0:
            return 0.0
        # at least one forward, so at least the smaller overhead once
        return self._work_floor(total_tokens, total_kv_tokens) + min(
            self.decode_overhead, self.multi_overhead
        )

    def _work_floor(self, total_tokens: int, total_kv_tokens: int) -> float:
        dec, multi = self.decode, self.multi or self.decode
        if isinstance(dec, Linear) and isinstance(multi, Linear):
            kv = min(dec.d, multi.d) * total_kv_tokens
            return min(dec.floor(total_tokens, True), multi.floor(total_tokens, False)) + kv
        if isinstance(dec, Roofline) and isinstance(multi, Roofline):
            mem = min(
                (f.weight_bytes + f.kv_bytes_per_token * total_kv_tokens) / f.bandwidth
                for f in (dec, multi)
            )
            flops = min(f.flops_per_token / f.peak_flops for f in (dec, multi))
            return ROOFLINE_SLACK * max(mem, flops * total_tokens)
        raise ValueError("floor: decode and multi-token fits of different kinds")


def _fit_linear(pts: list[dict[str, Any]]) -> Linear:
    """Non-negative least squares by exhaustive support (four unknowns)."""
    x = np.array(
        [[1.0, r["batch"], r["new_tokens"], r["batch"] * r["context"]] for r in pts], dtype=float
    )
    y = np.array([r["step_ms"] / 1000 for r in pts])
    best: tuple[float, np.ndarray] | None = None
    for mask in range(1, 16):
        cols = [i for i in range(4) if mask >> i & 1]
        coef, *_ = np.linalg.lstsq(x[:, cols], y, rcond=None)
        if (coef < 0).any():
            continue
        err = float(np.abs(x[:, cols] @ coef - y).sum())
        if best is None or err < best[0] - 1e-12:
            full = np.zeros(4)
            full[cols] = coef
            best = (err, full)
    assert best is not None  # the constant alone is always non-negative
    return Linear(*(float(v) for v in best[1]))


def rows_from_decode_step(result: dict[str, Any]) -> list[dict[str, Any]]:
    """decode_step.py's rows in the fit's format: per shape the fastest path (the runner uses
    CUDA graphs where a decode bucket fits, eager otherwise), new_tokens as the forward's total
    (decode_step gives a catch-up's tokens per request), context as the KV slots the step
    read per row (kv_tokens / batch: a shared-decode row's prefix counts once per pass);
    skipped and failed rows left out."""
    best: dict[tuple[Any, ...], dict[str, Any]] = {}
    for r in result["rows"]:
        if "step_ms" not in r:
            continue
        total = r["batch"] * r.get("new_tokens", 1)
        context = r.get("kv_tokens", r["batch"] * r["context"]) / r["batch"]
        key = (r["model"], r["batch"], total, context)
        if key not in best or r["step_ms"] < best[key]["step_ms"]:
            best[key] = {
                "model": r["model"],
                "path": "auto",
                "kind": r["kind"],
                "batch": r["batch"],
                "new_tokens": total,
                "context": context,
                "step_ms": r["step_ms"],
                "source": f"decode_step.py, path {r['path']}",
            }
    return list(best.values())


def measured_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The fit's rows of a measurements file: data/*.json's own rows, or decode_step.py's
    (recognised by its "checks") through rows_from_decode_step."""
    return rows_from_decode_step(data) if "checks" in data else list(data["rows"])


@dataclass(frozen=True)
class EngineOverhead:
    """Seconds the engine adds to one forward beyond the isolated forward decode_step.py times
    (host preparation, synchronisation, bookkeeping between forwards), per model and kind:
    fitted by tools/clock_check.py from serving rows of the same run."""

    decode_s: float = 0.0
    multi_s: float = 0.0

    @classmethod
    def load(cls, path: Path) -> dict[str, EngineOverhead]:
        data = json.loads(path.read_text())
        return {
            model: cls(v["decode_ms"] / 1e3, v["multi_ms"] / 1e3)
            for model, v in data["overhead"].items()
        }


def overhead_path(profile: str) -> Path:
    return DATA / f"{profile}.engine.json"


def _fit(rows: list[dict[str, Any]], model: str) -> ForwardCost:
    mine = [r for r in rows if r["model"] == model and r.get("path", "torch") in ("torch", "auto")]
    decode = [r for r in mine if r["new_tokens"] <= r["batch"]]
    multi = [r for r in mine if r["new_tokens"] > r["batch"]]
    if len(decode) < 2:
        raise ValueError(f"no GPU decode measurements of {model!r} to fit")
    return ForwardCost(model, _fit_linear(decode), _fit_linear(multi) if len(multi) >= 2 else None)


class GpuClock:
    """Prices the small and the large model's forwards on a GPU cost profile.

    shared_prefix: whether the modelled runner reads a forward's shared slot-list prefix once
    (see the module docstring); None: the profile's default (True for "h200-roofline", the
    runner being built; for a measured fit what its file says: decode_step.py records
    "shared_prefix_attention", older files read KV per request).

    engine_overhead: add the profile's EngineOverhead (its data/<profile>.engine.json, where
    one was fitted) to every forward; False prices isolated forwards."""

    def __init__(
        self,
        small: str = "qwen3-0.6b",
        large: str = "qwen3-8b",
        profile: str = DEFAULT_PROFILE,
        shared_prefix: bool | None = None,
        engine_overhead: bool = True,
    ) -> None:
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {PROFILES}, got {profile!r}")
        for name in (small, large):
            if name not in PRESETS:
                raise ValueError(f"unknown model shape {name!r}: one of {sorted(PRESETS)}")
        self.small_name, self.large_name, self.profile = small, large, profile
        if profile == "h200-roofline":
            self.costs = (self.roofline(small), self.roofline(large))
            default = True
        else:
            data = json.loads((DATA / f"{profile}.json").read_text())
            rows = measured_rows(data)
            self.costs = (_fit(rows, small), _fit(rows, large))
            default = bool(data.get("shared_prefix_attention", False))
            path = overhead_path(profile)
            if engine_overhead and path.exists():
                self.costs = self._costs_with(EngineOverhead.load(path))
        self._set_shared_prefix(default if shared_prefix is None else shared_prefix)

    def with_overhead(self, overhead: dict[str, EngineOverhead]) -> GpuClock:
        """A copy of this clock whose forwards cost each model's EngineOverhead (by model
        name) on top of the isolated forward."""
        clock = copy.copy(self)
        clock.costs = self._costs_with(overhead)
        return clock

    def _costs_with(self, overhead: dict[str, EngineOverhead]) -> tuple[ForwardCost, ForwardCost]:
        small, large = (
            replace(cost.isolated(), decode_overhead=o.decode_s, multi_overhead=o.multi_s)
            for cost in self.costs
            for o in [overhead.get(cost.model, EngineOverhead())]
        )
        return small, large

    def _set_shared_prefix(self, on: bool) -> None:
        """The shared-prefix kernel's shape of each model, with a bf16 cache (the benchmarks':
        fp32 caches run smaller tiles, PrefixShape.rows)."""
        self.shared_prefix = bool(on)
        shapes: list[PrefixShape] = []
        for name in (self.small_name, self.large_name):
            cfg = PRESETS.get(name)
            if cfg is None and self.shared_prefix:
                raise ValueError(
                    f"shared_prefix needs the attention shape of {name!r}: one of {sorted(PRESETS)}"
                )
            shapes.append(PrefixShape(1, 1, 1) if cfg is None else PrefixShape.of(cfg))
        self.prefix_shapes = (shapes[0], shapes[1])

    @staticmethod
    def roofline(name: str) -> ForwardCost:
        roof = Roofline.of(name)
        return ForwardCost(name, roof, roof)

    @classmethod
    def fit(
        cls, path: str | Path, small: str, large: str, shared_prefix: bool | None = None
    ) -> GpuClock:
        """A clock fitted to another measurements file: data/*.json's row format, or what
        benches/gpu/decode_step.py writes (its runs under benches/gpu/results/).
        shared_prefix: whether the measured runner read a shared prefix once; None: what the
        file says (decode_step.py records "shared_prefix_attention"), else False."""
        clock = cls.__new__(cls)
        clock.small_name, clock.large_name, clock.profile = small, large, str(path)
        data = json.loads(Path(path).read_text())
        if "rows" not in data or any("system" in r for r in data["rows"][:1]):
            raise ValueError(
                f"{path}: not forward measurements (data/*.json rows or decode_step.py's "
                "JSON; a routing_step.py result holds serving runs, not forward costs)"
            )
        rows = measured_rows(data)
        clock.costs = (_fit(rows, small), _fit(rows, large))
        if shared_prefix is None:
            shared_prefix = bool(data.get("shared_prefix_attention", False))
        clock._set_shared_prefix(shared_prefix)
        return clock

    def prefix_of(self, kind: int, kv_slots: Any, kv_offsets: Any, q_offsets: Any) -> PrefixRead:
        """How this model's modelled runner reads the shared prefixes of one forward, from its
        slot lists (numpy arrays or CPU tensors, viewed, not copied): the runner's rule
        (HostBatch.prefix_groups: find_prefix_groups, then paying_groups with this model's
        PrefixShape, decode when every row has one new token). NO_PREFIX without
        shared_prefix. The clock's batches have no padding rows (a runner's decode buckets
        add some, whose partials it also writes: a few slots more, not modelled)."""
        if not self.shared_prefix:
            return NO_PREFIX
        slots, kv_off, q_off = _np64(kv_slots), _np64(kv_offsets), _np64(q_offsets)
        return self.prefix_read(kind, find_prefix_groups(slots, kv_off, q_off), q_off)

    def prefix_of_host(self, kind: int, host: HostBatch) -> PrefixRead:
        """prefix_of for a forward the engine prepared: its candidate groups come from the
        slot table's kept facts (HostBatch.candidate_groups), not a search of slot lists."""
        if not self.shared_prefix:
            return NO_PREFIX
        return self.prefix_read(kind, host.candidate_groups(), host.q_offsets)

    def prefix_read(
        self, kind: int, groups: Sequence[PrefixGroup], q_offsets: np.ndarray
    ) -> PrefixRead:
        """The PrefixRead of candidate `groups` (find_prefix_groups's, or built by hand) over a
        forward with q_offsets: those that pay for this model (paying_groups), and their
        traffic (prefix_traffic)."""
        if not self.shared_prefix or not groups:
            return NO_PREFIX
        q_off = _np64(q_offsets)
        shape = self.prefix_shapes[kind]
        decode = int(q_off[-1] - q_off[0]) == len(q_off) - 1
        kept = paying_groups(groups, q_off, shape, decode)
        if not kept:
            return NO_PREFIX
        skipped, read = prefix_traffic(kept, q_off, shape, decode)
        return PrefixRead(tuple(kept), skipped, read)

    def kv_read(self, kv_tokens: float, prefix: PrefixRead = NO_PREFIX) -> float:
        """KV slots the modelled runner reads for a forward whose rows' contexts hold kv_tokens
        slots in all: with shared_prefix, kv_tokens - prefix.skipped + prefix.read (prefix_of
        of the forward: its paying groups' prefixes read once per block of their query rows,
        plus the split partials); without it (or NO_PREFIX), kv_tokens."""
        if not self.shared_prefix:
            return kv_tokens
        return kv_tokens - prefix.saved

    def forward_s(
        self,
        kind: int,
        batch: float,
        new_tokens: float,
        kv_tokens: float,
        prefix: PrefixRead = NO_PREFIX,
    ) -> float:
        """A forward of `batch` rows, new_tokens in all, over contexts of kv_tokens slots in
        all, whose shared prefixes this model's runner reads as `prefix` says (prefix_of;
        NO_PREFIX: every row reads its own slot list, or not known)."""
        return self.costs[kind](batch, new_tokens, self.kv_read(kv_tokens, prefix))

    def least_kv_read(self, kind: int, total_kv_tokens: int, rows: int, shareable: int) -> int:
        """The fewest KV slots any set of this model's forwards reads whose `rows` rows (one new
        token at least each) have contexts of total_kv_tokens slots in all, when no two rows
        share more than `shareable` (U) leading slots, however many prompts they come from.

        Without shared_prefix every row reads its context: total_kv_tokens. With it, a forward
        f reads sum(kv) - sum_g (n_g - passes(T_g))*P_g (plus the partials, >= 0) over its kept
        groups g of n_g rows, T_g >= n_g new tokens and P_g <= U (paying_groups keeps none, or
        only groups with passes(T_g) < n_g). Each group saves at most (n_g - passes(n_g))*U;
        passes (PrefixShape.passes: one per block of query rows, a ceil) is subadditive and
        n - passes(n) grows with n, so the groups of a forward of R_f rows save at most
        (R_f - passes(R_f))*U together, and all forwards at most (rows - passes(rows))*U. So:
        total - (rows - passes(rows))*U, every row's context beyond U and U read as few times
        as one forward of all rows in one group, one token each, would. Rows from K prompts
        that share under MIN_SHARED_PREFIX with one another need a group per prompt, so their
        own passes: this leaves out (passes(r_1) + ... + passes(r_K) - passes(rows))*U slots
        they also read (r_k: prompt k's rows; a few prompt lengths), loose but still a lower
        bound, which is what the bench's ceiling needs. U under MIN_SHARED_PREFIX is never
        shared (find_prefix_groups)."""
        if not self.shared_prefix or rows < 1 or shareable < MIN_SHARED_PREFIX:
            return total_kv_tokens
        passes = self.prefix_shapes[kind].passes(rows)
        return max(0, total_kv_tokens - (rows - passes) * shareable)

    def floor_s(self, kind: int, total_tokens: int, total_kv_tokens: int = 0) -> float:
        """What no schedule of this model's forwards writing total_tokens and reading
        total_kv_tokens KV slots in all undercuts (pass least_kv_read's count when forwards
        may share a prefix)."""
        return self.costs[kind].floor(total_tokens, total_kv_tokens)

    def describe(self) -> str:
        mode = "shared prefix read once" if self.shared_prefix else "KV read per request"
        return f"gpu:{self.profile} ({self.small_name} small, {self.large_name} large; {mode})"
