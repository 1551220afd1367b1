"""The one scheduler both drivers run: admission, make-room (evict, then preempt), catch-up
batching, and the commit of each forward's tokens (schedule -> run -> postprocess).

Drivers (drivers/events.py's event loop, drivers/threaded.py's two threads) call it while
holding its lock and run the forwards themselves; a request inside a running forward is `busy`
and nobody else touches it. Every way out (finish, abort, preemption, an error in a forward, the
router or the allocator) releases the request's KV in both models: nothing stays pinned or
allocated.

Its parts, each a class in a module of its own, each using only what it inherits:
RequestLists (request_lists.py: the lists and every way out of them), Admission
(admission.py: who enters, room made for a forward), BatchPlanning (batch_planning.py: the
next small step and catch-up, when a catch-up launches), ForwardFinishing
(forward_finishing.py: a forward's tokens committed). Its settings are SchedulerConfig
(scheduler_config.py); the launch policies' rules and prices are in launch_policy.py."""

from __future__ import annotations

from .batch_planning import BatchPlanning
from .forward_finishing import ForwardFinishing


class Scheduler(BatchPlanning, ForwardFinishing):
    """Scheduler(sides, config, router, handle_cls, barrier, holdback): the small and the
    large model's KV sides, the settings, the router, the KV handle type each request gets
    per model, barrier (the naive dispatchers: every parked request launches each step) and
    holdback (the shared-prefix admission hold-back)."""
