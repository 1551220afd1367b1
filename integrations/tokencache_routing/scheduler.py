"""Scheduling policy: continuous admission and delayed batching of large-model catch-ups."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerConfig:
    """max_running: requests admitted at once (decoding or parked). A catch-up batch for the
    large model launches once min_large_batch requests are parked, or the oldest has waited
    max_wait_steps small steps, or the small model has nothing else to run. The naive dispatcher
    ignores the delay: a synchronous barrier sends every parked request each step.
    In the threaded mode the delay is wall-clock: max_wait_s seconds instead of max_wait_steps.
    A request's first catch-up that shares a prompt page with another first catch-up in the
    same batch is held for the next batch, never longer (batch.take_catchup_batch)."""

    max_running: int = 32
    min_large_batch: int = 1
    max_wait_steps: int = 0
    max_large_batch: int | None = None
    max_wait_s: float = 0.0

    def launch_large(self, num_parked: int, oldest_wait: int, small_has_work: bool) -> bool:
        if num_parked == 0:
            return False
        return (
            not small_has_work
            or num_parked >= self.min_large_batch
            or oldest_wait >= self.max_wait_steps
        )
