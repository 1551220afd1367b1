"""The scheduler's settings: batch caps, the launch policy's knobs and the token budgets of
chunked prefill, checked when made."""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import launch_policy
from .launch_policy import LAUNCH_POLICIES, LaunchPolicy
from .state import SMALL


def _check_int(name: str, v: object, lo: int) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise ValueError(f"SchedulerConfig.{name} must be an int >= {lo}, got {v!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """max_running: requests decoding on the small model at once (its batch cap).
    max_parked: requests admitted beyond that (None: as many as max_running; 0: none), so the
    places of parked requests and of those inside a catch-up are filled instead of stepping a
    fragment. Admission is FCFS up to max_admitted = max_running + max_parked whatever the
    batch holds; when more are ready than max_running, the small batch takes the longest
    waiting first (Scheduler.admit, schedule_small).
    On one device (a catch-up stalls the small model), a catch-up launches once
    min_large_batch requests are parked, or the oldest has waited max_wait_steps small steps
    (max_wait_s seconds in the threaded driver), or the small model has nothing else to run,
    or parked requests nobody replaced leave the small batch below min_occupancy of what could
    run (min(max_running, admitted)): while the queue refills their places, waiting for a
    bigger catch-up costs the small model nothing; in a drained tail each parked request is a
    hole. With the large model on its own device, a catch-up launches whenever that device is
    idle and anything is parked (those three knobs do not apply). The naive dispatchers ignore
    the delay: a synchronous barrier sends every parked request each step. A first catch-up
    that shares a prompt page with another in the same batch is held for the next batch, never
    longer.
    Chunked prefill: a small step computes at most chunked_prefill_size tokens and a catch-up
    at most large_chunked_prefill_size (None: chunked_prefill_size; 0: no budget), as
    SGLang's chunked_prefill_size / vLLM's max_num_batched_tokens. Decode rows go first, the
    rest of the budget to prefills and catch-ups in the scheduler's order (batch.chunk_ends);
    a request whose chunk stops short of its last token commits the chunk's KV and keeps its
    place (running, or parked: a catch-up finishes before its request rejoins the small model)
    for the next step, where it goes on; only its last chunk samples. Default 2048 (vLLM's
    long-standing default; SGLang's for small GPUs): on the h200-roofline clock a step of
    Qwen3-0.6B costs the same with a 2048-token chunk beside 31 decode rows at 6.6k context as
    without it (8 ms, the KV read hides the chunk's FLOPs), and any chunk of 256 tokens or more
    is compute-bound already (a bigger one saves nothing); a 2048-token catch-up chunk of
    Qwen3-8B costs 51 ms, a one-device stall that a smaller large_chunked_prefill_size
    shortens (BENCHMARKS.md, "Chunked prefill").
    launch: "threshold" (default), the rules above; "cost", decided from the engine clock's
    prices instead of knobs (ski rental): at each small step the scheduler adds what the
    parked requests' unrefilled places cost that step (hole_loss_s: their share of the step's
    fixed part, the weight read and host time a hole wastes; their KV reads are deferred, not
    saved) and launches a catch-up once that sum reaches the catch-up's fixed cost
    (catchup_fixed_s: the large model's weight read on the roofline, plus the host time the
    clock charges a catch-up), then starts again from 0. Hard triggers as before: nothing
    else to run, a catch-up chunk not finished, the large model on its own device; also
    max_large_batch parked, and max_wait_steps / max_wait_s when > 0 (a latency cap; 0:
    none).
    min_large_batch and min_occupancy do not apply. While the queue refills parked places
    nothing is lost and the catch-up waits (until max_parked are parked, then places go
    empty). BENCHMARKS.md, "The launch policy on the refit clock"."""

    max_running: int = 32
    min_large_batch: int = 1
    max_wait_steps: int = 0
    max_large_batch: int | None = None
    max_wait_s: float = 0.0
    max_parked: int | None = None
    # 0.5, not a fuller batch: an eager catch-up costs ~37 ms in the engine whatever its size,
    # so fewer, larger ones pay (BENCHMARKS.md, "The launch policy on the refit clock")
    min_occupancy: float = 0.5
    chunked_prefill_size: int = 2048
    large_chunked_prefill_size: int | None = None
    launch: LaunchPolicy = "threshold"

    def __post_init__(self) -> None:
        if self.launch not in LAUNCH_POLICIES:
            raise ValueError(
                f"SchedulerConfig.launch must be one of {LAUNCH_POLICIES}, got {self.launch!r}"
            )
        _check_int("max_running", self.max_running, 1)
        _check_int("chunked_prefill_size", self.chunked_prefill_size, 0)
        if self.large_chunked_prefill_size is not None:
            _check_int("large_chunked_prefill_size", self.large_chunked_prefill_size, 0)
        _check_int("min_large_batch", self.min_large_batch, 1)
        _check_int("max_wait_steps", self.max_wait_steps, 0)
        if self.max_large_batch is not None:
            _check_int("max_large_batch", self.max_large_batch, 1)
        if self.max_parked is not None:
            _check_int("max_parked", self.max_parked, 0)
        w = self.max_wait_s
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ValueError(f"SchedulerConfig.max_wait_s must be a finite number >= 0, got {w!r}")
        o = self.min_occupancy
        if isinstance(o, bool) or not isinstance(o, (int, float)) or not 0 <= o <= 1:
            raise ValueError(f"SchedulerConfig.min_occupancy must be in [0, 1], got {o!r}")

    def token_budget(self, kind: int) -> int:
        """The most tokens one forward of that model computes (0: no budget)."""
        large = self.large_chunked_prefill_size
        return self.chunked_prefill_size if kind == SMALL or large is None else large

    @property
    def max_admitted(self) -> int:
        parked = self.max_running if self.max_parked is None else self.max_parked
        return self.max_running + parked

    def waited_out(self, waited: float, cap: float) -> bool:
        """launch_policy.waited_out on these settings."""
        return launch_policy.waited_out(self, waited, cap)

    def launch_large(
        self,
        num_parked: int,
        waited_out: bool,
        num_on_small: int,
        num_admitted: int,
        own_device: bool = False,
        hole_loss_s: float = 0.0,
        fixed_s: float = 0.0,
    ) -> bool:
        """Launch a catch-up now (the large model is idle)? launch_policy.launch_large on
        these settings."""
        return launch_policy.launch_large(
            self,
            num_parked,
            waited_out,
            num_on_small,
            num_admitted,
            own_device,
            hole_loss_s,
            fixed_s,
        )
