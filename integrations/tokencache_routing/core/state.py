"""The types the scheduler, both drivers and the public API share: a request's state, its
sampling parameters, the caller's handle on it, the engine's counters, and what a handle asks
of its engine (RequestDriver, a typed Protocol that RoutedEngine implements; the driver
interfaces, which name the Scheduler, are in driver_api.py)."""

from __future__ import annotations

import math
import secrets
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import numpy as np

if TYPE_CHECKING:
    from .kv import KVHandle
    from .prefix import PrefixRead

SMALL, LARGE = 0, 1
# Why a request ended: max_new_tokens reached, an eos/stop token, RequestHandle.abort(), or an
# exception in its forward, its router call or the allocator (RequestHandle.error says which).
FINISH_REASONS = ("length", "stop", "abort", "error")


# SamplingParams' ranges. A temperature below MIN_TEMPERATURE samples greedily (argmax), as
# vLLM and SGLang treat theirs: softmax((l - max) / T) is then one-hot at float32 precision
# for all but near-ties, and T itself would soon be a subnormal or zero in float32. Above
# MAX_TEMPERATURE every distribution is uniform at that precision (and T near float32's max
# would turn a masked -inf logit into NaN). Seeds are what an int64 holds, non-negative
# (torch.Generator.manual_seed takes [0, 2**64) but other layers, JSON readers among them,
# stop at 2**63).
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e4
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below MIN_TEMPERATURE) is greedy (argmax); otherwise
    softmax((logits - max) / temperature) restricted to the top_p nucleus (the most likely
    tokens whose probabilities, before the last one, sum to less than top_p), drawn from a
    uniform that is a hash of `seed` and the token's place (reproducible per request,
    whatever the schedule; None: a random seed drawn once per request).
    Refused: temperature not a finite number in [0, MAX_TEMPERATURE] or top_p outside (0, 1]
    (ValueError), seed not an int (TypeError) or outside [0, MAX_SEED] (ValueError)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t, p, seed = self.temperature, self.top_p, self.seed
        number = (int, float, np.integer, np.floating)
        if (
            isinstance(t, bool)
            or not isinstance(t, number)
            or not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE)
        ):
            raise ValueError(
                f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], got {t!r}"
            )
        if isinstance(p, bool) or not isinstance(p, number) or not 0 < p <= 1:  # NaN too
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if seed is not None:
            if isinstance(seed, (bool, np.bool_)) or not isinstance(seed, (int, np.integer)):
                raise TypeError(f"seed must be an int or None, got {seed!r}")
            if not 0 <= seed <= MAX_SEED:
                raise ValueError(f"seed must be in [0, 2**63), got {seed!r}")
            object.__setattr__(self, "seed", int(seed))
        # Plain floats from here on: the sampler builds its tensors from them.
        object.__setattr__(self, "temperature", float(t))
        object.__setattr__(self, "top_p", float(p))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


GREEDY = SamplingParams()


class Request:
    """One request's tokens and KV handles, owned by the scheduler (its lock guards every field
    but the delivery ones, which the request's own `lock` guards)."""

    def __init__(
        self,
        rid: int,
        route_key: int,
        prompt: np.ndarray,
        max_new_tokens: int,
        sampling: SamplingParams,
        stop_token_ids: frozenset[int],
        lock: threading.RLock | None = None,
    ) -> None:
        self.rid = rid
        self.route_key = route_key  # what routers see as the request id (RouterFeatures.rids)
        self.prompt_len = len(prompt)
        self.max_new_tokens = max_new_tokens
        self.seq = np.empty(len(prompt) + max_new_tokens, dtype=np.int64)
        self.seq[: len(prompt)] = prompt
        self.n = len(prompt)
        self.kv: list[KVHandle] = []
        self.sampling = sampling
        self.stop_token_ids = stop_token_ids
        self._own_seed: int | None = None  # seed=None: drawn once, on first use
        self.parked_at = 0.0  # engine clock (threaded driver: its wall clock)
        self.parked_step = 0  # small steps so far when parked (event loop)
        self.admit_order = -1
        self.last_small_step = -1  # the small step that last ran it (or admitted it)
        self.held_catchup = False  # held out of a catch-up batch once: goes in the next one
        # Chunked prefill: its last forward ran a chunk short of its last pending token (a
        # prefill on the small model, or a catch-up, which then finishes before it rejoins)
        self.partial_prefill = False
        # SMALL or LARGE while inside that model's forward running now (threaded driver), else -1
        self.busy_model = -1
        # delivery to the caller
        # Guards the delivery fields. A plain lock, not a condition: nobody blocks on a
        # request (waits poll, RoutedEngine._progress; listeners are called), so a commit
        # pays for no notify. An engine's requests share one (Scheduler.delivery_lock), so a
        # step delivers all its tokens under one acquire.
        self.lock = threading.RLock() if lock is None else lock
        self.tokens: list[int] = []
        self.token_models: list[int] = []
        self.finished_reason: str | None = None
        # Why it ends, set with its last token (before its KV is released and finished_reason
        # set): abort() refuses from then on, as the caller may already hold that token.
        self.ending: str | None = None
        self.error: BaseException | None = None
        self.abort_requested = False
        # A listener of this request raised: it ends with that error at the next iteration
        # (abort_requested is set with it), its batch-mates unaffected.
        self.failure: BaseException | None = None
        self.listeners: list[Callable[[RequestHandle], None]] = []
        self.handle: RequestHandle | None = None
        self.submitted_at = 0.0
        self.token_times: list[float] = []  # engine clock at each delivered token

    @property
    def busy(self) -> bool:
        """Inside a forward that is running now: nobody else preempts or touches it."""
        return self.busy_model != -1

    @property
    def seed(self) -> int:
        """The sampling seed: SamplingParams.seed, or one drawn for this request once."""
        if self.sampling.seed is not None:
            return self.sampling.seed
        if self._own_seed is None:
            self._own_seed = secrets.randbits(63)
        return self._own_seed

    @property
    def num_generated(self) -> int:
        return self.n - self.prompt_len


class RequestDriver(Protocol):
    """What a RequestHandle asks of its engine (RoutedEngine implements it): each call drives
    the engine inline when no driver thread does."""

    def wait_request(self, r: Request, timeout: float | None) -> bool:
        """Blocks until r finished or `timeout` seconds passed; True when it finished."""
        ...

    def abort_request(self, r: Request) -> bool:
        """Marks r aborted (the driver releases it at its next iteration); False when it had
        already finished, was ending or was aborted."""
        ...

    def wait_for_progress(self, r: Request, seen: int) -> None:
        """Returns once r has more than `seen` tokens or finished, or after a short wait."""
        ...


class RequestHandle:
    """The caller's view of a submitted request (RoutedEngine.submit). Thread-safe."""

    def __init__(self, req: Request, engine: RequestDriver) -> None:
        self._req = req
        self._engine = engine
        req.handle = self

    @property
    def rid(self) -> int:
        return self._req.rid

    @property
    def prompt_len(self) -> int:
        return self._req.prompt_len

    @property
    def tokens(self) -> list[int]:
        """Tokens delivered so far (a copy)."""
        with self._req.lock:
            return list(self._req.tokens)

    @property
    def models(self) -> list[int]:
        """Per delivered token: 0 = the small model wrote it, 1 = the large model."""
        with self._req.lock:
            return list(self._req.token_models)

    @property
    def finished_reason(self) -> str | None:
        return self._req.finished_reason

    @property
    def error(self) -> BaseException | None:
        return self._req.error

    @property
    def token_times(self) -> list[float]:
        """Engine clock (seconds) at each delivered token; submission is at submitted_at."""
        with self._req.lock:
            return list(self._req.token_times)

    @property
    def submitted_at(self) -> float:
        return self._req.submitted_at

    def done(self) -> bool:
        return self._req.finished_reason is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Blocks until the request finished (drives the engine when nothing else does)."""
        return self._engine.wait_request(self._req, timeout)

    def abort(self) -> bool:
        """Stops the request: no token is delivered after this returns; its KV is released at
        the engine's next iteration. False when it had already finished."""
        return self._engine.abort_request(self._req)

    def tokens_since(self, start: int) -> tuple[list[int], list[int]]:
        """(tokens, models) delivered from index `start` on: O(new tokens), for listeners."""
        with self._req.lock:
            return self._req.tokens[start:], self._req.token_models[start:]

    def add_listener(self, fn: Callable[[RequestHandle], None]) -> None:
        """fn(handle) runs on the engine's driver thread after new tokens and once at the end.
        Called at once when tokens or the end are already there."""
        with self._req.lock:
            self._req.listeners.append(fn)
            now = bool(self._req.tokens) or self.done()
        if now:
            fn(self)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        """(token, model) pairs as they are delivered; ends when the request finishes."""
        i = 0
        while True:
            with self._req.lock:
                if i < len(self._req.tokens):
                    batch = list(zip(self._req.tokens[i:], self._req.token_models[i:], strict=True))
                    i += len(batch)
                else:
                    batch = []
                    if self.done():
                        return
            if batch:
                yield from batch
            else:
                self._engine.wait_for_progress(self._req, i)

    def __repr__(self) -> str:
        state = self.finished_reason or "running"
        return f"RequestHandle(rid={self.rid}, tokens={len(self._req.tokens)}, {state})"


@dataclass
class Stats:
    """Counters of one engine (or of one generate call: Stats.since)."""

    steps: int = 0
    tokens: int = 0
    escalations: int = 0
    preemptions: int = 0
    aborted: int = 0  # requests stopped by an abort while the engine still held them
    failed: int = 0  # requests ended by an error
    finished: int = 0  # requests ended for any reason
    large_tokens: int = 0  # tokens the large model wrote
    wall_s: float = 0.0
    small_forward_s: float = 0.0
    large_forward_s: float = 0.0
    bookkeeping_s: float = 0.0  # inside tree and cursor operations
    # Host time of the event loop's steps (everything but the forwards' device work: the
    # scheduler, the runner's preparation, sampling, the router, commits, the trees), and the
    # small steps' share of it beside their device cost on the engine clock.
    host_s: float = 0.0
    small_host_s: float = 0.0
    small_device_s: float = 0.0
    # Engine clock time the small model's device waits for the host: all its host time
    # without overlap, the launches that came late with it (GPU idle).
    device_idle_s: float = 0.0
    small_tokens: int = 0  # tokens the small model computed (prefills, catch-ups and decodes)
    # Overlap: rows a small step computed for a request the step before parked or ended
    # (dropped, not committed; not in small_tokens)
    dropped_rows: int = 0
    held_back: int = 0  # admissions delayed a step so a shared prefix is prefilled once
    large_held_back: int = 0  # first catch-ups held a batch so a shared prefix is prefilled once
    prefill_chunks: int = 0  # rows of forwards whose chunk stopped short (chunked prefill)
    # Of those, the catch-ups' rows and their contexts (catchup_kv_tokens includes them): what
    # a schedule without chunks would not read (the bench's ceiling leaves them out)
    catchup_partial_rows: int = 0
    catchup_partial_kv_tokens: int = 0
    modeled_s: float = 0.0  # engine clock: measured, step units or the GPU cost model
    small_idle_s: float = 0.0  # engine clock time the small model waits for the large one
    small_batch_sizes: list[int] = field(default_factory=list)
    # Per small step: min(max_running, admitted unfinished requests), what could have run.
    small_batch_capacity: list[int] = field(default_factory=list)
    catchup_batch_sizes: list[int] = field(default_factory=list)
    catchup_tokens: list[int] = field(default_factory=list)  # tokens prefilled per catch-up
    # Per catch-up: its rows' contexts in KV slots (sum of kv_lens: what a runner reading each
    # row's KV itself reads), and the prefix groups the GPU clock's runner read once with their
    # traffic (GpuClock.prefix_of; NO_PREFIX: none, or a clock without shared-prefix reads).
    # KV it read: GpuClock.kv_read(kv_tokens, prefix); its longest P: prefix.longest.
    catchup_kv_tokens: list[int] = field(default_factory=list)
    catchup_shared_prefix: list[PrefixRead] = field(default_factory=list)
    # Forwards by model and path ("small decode graph", "large extend eager", ...;
    # ModelExecutor.path_of): graph coverage as a number.
    forward_paths: dict[str, int] = field(default_factory=dict)

    def graph_share(self, side: str | None = None) -> float:
        """Of the forwards (of side "small" or "large", or both), the share that did not run
        eagerly: graph replays, or a graph runner's static path off CUDA."""
        mine = {k: v for k, v in self.forward_paths.items() if side is None or k.startswith(side)}
        total = sum(mine.values())
        eager = sum(v for k, v in mine.items() if k.endswith("eager"))
        return (total - eager) / total if total else 0.0

    @property
    def bookkeeping_share(self) -> float:
        busy = self.small_forward_s + self.large_forward_s + self.bookkeeping_s
        return self.bookkeeping_s / busy if busy else 0.0

    @property
    def small_idle_share(self) -> float:
        return self.small_idle_s / self.modeled_s if self.modeled_s else 0.0

    @property
    def small_batch_occupancy(self) -> float:
        """Mean over small steps of batch size / min(max_running, admitted unfinished requests):
        1.0 when every step runs all it could; parked requests whose places were refilled from
        the queue leave no hole, a straggler tail or a fragmented batch does."""
        pairs = [
            b / r
            for b, r in zip(self.small_batch_sizes, self.small_batch_capacity, strict=True)
            if r
        ]
        return sum(pairs) / len(pairs) if pairs else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def modeled_tokens_per_s(self) -> float:
        return self.tokens / self.modeled_s if self.modeled_s else 0.0

    def copy(self) -> Stats:
        out = Stats(**{k: getattr(self, k) for k in self.__dataclass_fields__})
        for k, v in vars(out).items():
            if isinstance(v, (list, dict)):
                setattr(out, k, type(v)(v))
        return out

    def since(self, start: Stats) -> Stats:
        """What happened after the snapshot `start` (counters subtracted, lists sliced)."""
        out = Stats()
        for k in self.__dataclass_fields__:
            now, then = getattr(self, k), getattr(start, k)
            if isinstance(now, dict):
                diff = {key: n - then.get(key, 0) for key, n in now.items()}
                setattr(out, k, {key: n for key, n in diff.items() if n})
            else:
                setattr(out, k, now[len(then) :] if isinstance(now, list) else now - then)
        return out


@dataclass
class GenerateResult:
    tokens: list[list[int]]
    models: list[list[int]]  # per token: 0 = small model, 1 = large model
    texts: list[str] | None
    stats: Stats
    # per request: "length" (max_new_tokens), "stop" (eos), "abort" (its tokens are those
    # delivered before the abort) or "error"
    finished_reasons: list[str] = field(default_factory=list)

    @property
    def aborted(self) -> list[bool]:
        return [f == "abort" for f in self.finished_reasons]


def as_token_array(prompt: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """Validated int64 copy of a prompt: a non-empty sequence of ints in [0, vocab)."""
    if isinstance(prompt, (str, bytes)):
        raise TypeError("a prompt is a sequence of token ids, not a string (tokenize it first)")
    arr = np.asarray(prompt)
    if arr.ndim != 1:
        raise ValueError(f"a prompt must be a flat sequence of token ids, got shape {arr.shape}")
    if len(arr) == 0:
        raise ValueError("prompts must not be empty")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"token ids must be integers, got {arr.dtype} (e.g. {prompt[0]!r})")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= vocab_size:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})")
    return arr.astype(np.int64)
