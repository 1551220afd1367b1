"""Prices on the engine clock: what a launched forward costs (`forward_cost`, once per
forward) and what the scheduler's cost-based launch policy weighs holes and catch-ups with
(`launch_prices`). Every dispatch (tokencache, naive, naive-sglang) is priced here, on the same
modelled runner: a GpuClock (clock.py), the step clock's constants (a small step 1, a catch-up
large_step_cost), or the measured forward times."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..core.launch_policy import MeasuredPrices
from ..core.state import SMALL, Stats
from .clock import GpuClock

if TYPE_CHECKING:
    from ..core.batch import PreparedForward
    from ..core.launch_policy import Price


def launch_prices(
    gpu: GpuClock | None,
    clock: str,
    large_step_cost: float,
    host_charge: str,
    overlapped: bool,
    stats: Stats,
) -> Price:
    """What SchedulerConfig(launch="cost") prices holes and catch-ups with (both drivers):
    the GPU clock's model of a forward (shared prefixes not modelled: every row reads its
    slot list) plus the host time the clock charges for it (host_charge "serial" or
    "overlap"; the average so far, Stats.small_host_s per small step: a catch-up then waits
    for the next step's preparation), so that a host-bound step's fixed cost counts as the
    weight read does; the step clock's constants; or, on the measured clock, MeasuredPrices
    learning from the forwards' measured times. overlapped: the host work of the next step
    runs beside the device's (overlapped scheduling, or host_charge "overlap")."""
    if gpu is None and clock == "steps":

        def steps(kind: int, batch: int, _tokens: int, _kv: int) -> float:
            return 0.0 if batch <= 0 else 1.0 if kind == SMALL else large_step_cost

        return steps
    if gpu is None:
        return MeasuredPrices()
    if host_charge == "trees":
        return gpu.forward_s
    device_model, st = gpu, stats

    def priced(kind: int, batch: int, tokens: int, kv: int) -> float:
        device = device_model.forward_s(kind, batch, tokens, kv)
        if batch <= 0:
            return device
        per_step = st.small_host_s / st.steps if st.steps else 0.0
        if kind == SMALL:  # overlapped, a step costs the slower of its host and device
            return max(device, per_step) if overlapped else device + per_step
        # On one device a catch-up is serial: (overlapped) the device then waits for the
        # next small step's preparation. Its own host work is mostly per row (its rows'
        # commits and tree extends), not counted.
        return device + (per_step if overlapped else 0.0)

    return priced


def forward_cost(
    gpu: GpuClock | None,
    clock: str,
    large_step_cost: float,
    kind: int,
    prep: PreparedForward,
    measured_s: float,
) -> float:
    """The forward's device cost on the engine clock (measured_s: its measured device time).
    A GPU clock whose runner reads shared prefixes once gets the forward's prefix groups and
    their traffic (GpuClock.prefix_of_host, recorded on prep for the stats); finding the
    groups is host work the modelled runner does too (RoutedEngine.runner_host_work, timed
    before this is called)."""
    if gpu is not None:
        if gpu.shared_prefix:
            prep.shared_prefix = gpu.prefix_of_host(kind, prep.host)
        kv = int(prep.kv_lens.sum())
        batch, tokens = len(prep.batch), prep.num_tokens
        return gpu.forward_s(kind, batch, tokens, kv, prep.shared_prefix)
    if clock == "measured":
        return measured_s
    return 1.0 if kind == SMALL else large_step_cost
