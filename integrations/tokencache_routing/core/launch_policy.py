"""When a catch-up launches and what it is worth: the launch policies' rules and the prices
they compare.

A forward's price comes from the engine's clock (RoutedEngine.launch_prices builds it from
sim/clock.py's GpuClock, the step clock's constants, or MeasuredPrices here). The rules live in
core/ rather than beside the clock in sim/ because the scheduler applies them at every step and
core/ imports nothing of sim/ (tests/packaging/test_import_graph.py): the clock reaches the
scheduler only as a Price, a plain callable.

Two policies (SchedulerConfig.launch): "threshold", knobs (a batch size, a wait, an occupancy
floor); "cost", ski rental: the loss the parked requests' empty places cause the small model,
summed step by step (hole_loss_s), against the fixed cost of a catch-up (catchup_fixed_s)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal, Protocol, get_args

from .state import LARGE, SMALL

LaunchPolicy = Literal["threshold", "cost"]
LAUNCH_POLICIES: tuple[str, ...] = get_args(LaunchPolicy)

# What a forward costs on the engine's clock: price(kind, batch, new_tokens, kv_tokens) in
# seconds (or the step clock's units). The engine builds it from its clock (RoutedEngine,
# launch_prices): the GPU clock's model, the step clock's constants, or MeasuredPrices.
Price = Callable[[int, int, int, int], float]


def fixed_part(price: Price, kind: int, rows: int, tokens: int, kv_tokens: int) -> float:
    """A forward's fixed cost: its price at these rows minus their per-row part, taken as the
    intercept of the price's linear extension, 2 * P(rows) - P(2 * rows) (tokens and KV
    doubled too), never below 0. On a linear clock that is its constant; on the roofline a
    memory-bound forward's weight read (Qwen3-8B: ~5 ms on h200-roofline, Qwen3-0.6B:
    ~0.4 ms) and 0 for a compute-bound one (a bigger batch saves nothing there)."""
    if rows <= 0:
        return 0.0
    one = price(kind, rows, tokens, kv_tokens)
    return max(0.0, 2 * one - price(kind, 2 * rows, 2 * tokens, 2 * kv_tokens))


def hole_loss_s(
    price: Price, batch: int, tokens: int, kv_tokens: int, holes: int, hole_kv: int
) -> float:
    """What one small step of `batch` rows (tokens new, kv_tokens KV slots read) loses by
    running with `holes` empty places whose parked requests hold hole_kv slots of context:
    the time their tokens would take at the full batch's rate, minus what the holes save the
    step. Their KV is not saved, only deferred (their tokens read it when they come back), so
    what is lost is the holes' share of the full step's fixed part (fixed_part):
    holes / (batch + holes) * fixed. Where the parked contexts are the batch's mean that is
    exactly holes * full / (batch + holes) - (full - now); where they are longer, that
    difference would count a deferred read as a saving (and could fall to 0: a catch-up
    that never launches). On a KV-bound step a hole costs little: its share of the weight
    read (and of the host time the clock charges a step)."""
    if holes <= 0:
        return 0.0
    full = batch + holes
    return holes / full * fixed_part(price, SMALL, full, tokens + holes, kv_tokens + hole_kv)


def catchup_fixed_s(price: Price, rows: int, tokens: int, kv_tokens: int) -> float:
    """A catch-up's fixed cost (fixed_part of the large model's forward): what launching it
    pays whatever its rows, the price a hole's accumulated loss is weighed against."""
    return fixed_part(price, LARGE, rows, tokens, kv_tokens)


def parked_catchup_fixed_s(price: Price, lengths: Sequence[int], contexts: Sequence[int]) -> float:
    """catchup_fixed_s of a catch-up of parked requests with these token counts (Request.n)
    and large-model contexts (the tokens the large model holds KV for already): it computes
    the difference, at least a token a row."""
    rows = len(lengths)
    tokens = sum(lengths) - sum(contexts)
    return catchup_fixed_s(price, rows, max(tokens, rows), sum(contexts))


class MeasuredPrices:
    """Prices from measured forward times, for clocks without a model of their own
    (clock="measured", the threaded driver's wall clock): a small step costs the moving
    average of the recent small steps (a GPU decode step costs about the same at any batch;
    what a hole saves is not modelled, so holes look dearer and catch-ups launch sooner) and a
    catch-up the least one measured so far (the smallest catch-ups are mostly the fixed cost),
    nothing before the first (the first parked request then launches at once)."""

    def __init__(self, decay: float = 0.9) -> None:
        self.decay = decay
        self.small_s: float | None = None
        self.large_s: float | None = None

    def observe(self, kind: int, seconds: float) -> None:
        if kind == SMALL:
            old = self.small_s
            self.small_s = seconds if old is None else self.decay * old + (1 - self.decay) * seconds
        else:
            self.large_s = seconds if self.large_s is None else min(self.large_s, seconds)

    def __call__(self, kind: int, batch: int, tokens: int, kv_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        seen = self.small_s if kind == SMALL else self.large_s
        return seen or 0.0


class LaunchKnobs(Protocol):
    """The settings the launch rules read (SchedulerConfig has them; its docstring says what
    each means)."""

    @property
    def launch(self) -> LaunchPolicy: ...

    @property
    def max_running(self) -> int: ...

    @property
    def min_large_batch(self) -> int: ...

    @property
    def max_large_batch(self) -> int | None: ...

    @property
    def min_occupancy(self) -> float: ...


def waited_out(knobs: LaunchKnobs, waited: float, cap: float) -> bool:
    """The oldest parked request has waited its maximum (`cap`: max_wait_steps, or
    max_wait_s in the threaded driver). Under launch="cost" a cap of 0 is none."""
    if knobs.launch == "cost" and cap <= 0:
        return False
    return waited >= cap


def launch_large(
    knobs: LaunchKnobs,
    num_parked: int,
    waited_out: bool,
    num_on_small: int,
    num_admitted: int,
    own_device: bool = False,
    hole_loss_s: float = 0.0,
    fixed_s: float = 0.0,
) -> bool:
    """Launch a catch-up now (the large model is idle)? num_on_small: requests holding a
    place in the small batch (Scheduler.num_on_small); num_admitted: admitted unfinished
    requests, parked included; waited_out: the oldest parked request has waited its
    maximum; own_device: the large model runs on a device of its own, so a catch-up
    stalls nobody and waiting for a bigger one only delays it (an idle large device
    is free; while it is busy, parked requests gather into the next batch anyway).
    launch="cost": hole_loss_s, what the holes cost the small model since the last
    catch-up, against fixed_s, the next catch-up's fixed cost."""
    if num_parked == 0:
        return False
    if own_device or num_on_small == 0 or waited_out:
        return True
    if knobs.launch == "cost":
        if knobs.max_large_batch is not None and num_parked >= knobs.max_large_batch:
            return True
        return hole_loss_s >= fixed_s
    if num_parked >= knobs.min_large_batch:
        return True
    could_run = min(knobs.max_running, num_admitted)
    return num_on_small < knobs.min_occupancy * could_run
