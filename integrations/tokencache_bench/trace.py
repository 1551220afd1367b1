"""One seeded token-routing trace that every cache implementation replays.

R requests decode in lockstep behind a shared system prompt. At every step each request escalates
its token to the large model with probability p; the request then returns to the small model and
hands its cache the tokens written since its last hand-off (~1/p tokens). The end of generation
(L tokens) is a final hand-off, so every generated token is cached exactly once.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

import numpy as np

DEFAULT_BUCKETS: tuple[int, ...] = (512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class TraceConfig:
    requests: int = 32
    system_len: int = 512
    question_len: int = 32  # per-request prompt after the shared system prompt
    escalation_p: float = 0.05
    max_gen: int = 8192
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    vocab: int = 151_936  # Qwen-sized vocabulary; only the ids' spread matters
    seed: int = 0


@dataclass(frozen=True)
class HandOff:
    """Request `request` appends sequence positions [start, end) at decode step `step`."""

    step: int
    request: int
    start: int
    end: int
    bucket: int  # smallest L bucket holding the generated length at this hand-off


@dataclass
class Trace:
    config: TraceConfig
    tokens: list[np.ndarray]  # per request: full sequence, int64, prompt + generation
    slots: list[np.ndarray]  # per request: KV slot of every position, int64
    prompt_len: int
    handoffs: list[HandOff]  # in step order, ties by request id
    fingerprint: str = field(default="")

    @property
    def requests(self) -> int:
        return len(self.tokens)

    def total_tokens(self) -> int:
        """Tokens a cache holds after the whole trace: the distinct prefixes of all sequences.

        Sorted lexicographically, each sequence shares with its predecessor exactly the prefix
        already counted (random ids do collide: 256 requests often share a first token).
        """
        seqs = sorted(self.tokens, key=lambda t: t.tolist())
        total = sum(len(t) for t in seqs)
        for a, b in itertools.pairwise(seqs):
            n = min(len(a), len(b))
            diff = np.flatnonzero(a[:n] != b[:n])
            total -= int(diff[0]) if len(diff) else n
        return total

    def steps(self) -> list[list[HandOff]]:
        """Hand-offs grouped by decode step (only steps that have any)."""
        groups: list[list[HandOff]] = []
        last = None
        for h in self.handoffs:
            if h.step != last:
                groups.append([])
                last = h.step
            groups[-1].append(h)
        return groups

    def num_steps(self) -> int:
        return self.config.max_gen


def _bucket_of(gen_len: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if gen_len <= b:
            return b
    return buckets[-1]


def make_trace(config: TraceConfig) -> Trace:
    rng = np.random.default_rng(config.seed)
    system = rng.integers(0, config.vocab, config.system_len, dtype=np.int64)
    prompt_len = config.system_len + config.question_len
    seq_len = prompt_len + config.max_gen
    tokens = []
    for _ in range(config.requests):
        own = rng.integers(0, config.vocab, seq_len - config.system_len, dtype=np.int64)
        tokens.append(np.ascontiguousarray(np.concatenate([system, own])))

    # Hand-off ends in generated-token coordinates: after every escalated token, and at L.
    ends_per_request = []
    for _ in range(config.requests):
        escalated = np.flatnonzero(rng.random(config.max_gen) < config.escalation_p) + 1
        ends_per_request.append(np.union1d(escalated, [config.max_gen]))

    handoffs = []
    for r, ends in enumerate(ends_per_request):
        start = prompt_len
        for e in ends.tolist():
            step = e - 1
            bucket = _bucket_of(e, config.buckets)
            handoffs.append(HandOff(step, r, start, prompt_len + e, bucket))
            start = prompt_len + e
    handoffs.sort(key=lambda h: (h.step, h.request))

    # A counter allocator: admissions take the prompt's slots first, then hand-offs in step
    # order take fresh slots, as a pool handing out the next free index would.
    slots = [np.empty(seq_len, dtype=np.int64) for _ in range(config.requests)]
    counter = 0
    for r in range(config.requests):
        slots[r][:prompt_len] = np.arange(counter, counter + prompt_len)
        counter += prompt_len
    for h in handoffs:
        n = h.end - h.start
        slots[h.request][h.start : h.end] = np.arange(counter, counter + n)
        counter += n

    digest = hashlib.sha256()
    for t, s in zip(tokens, slots, strict=True):
        digest.update(t.tobytes())
        digest.update(s.tobytes())
    digest.update(np.array([(h.request, h.start, h.end) for h in handoffs]).tobytes())
    return Trace(config, tokens, slots, prompt_len, handoffs, digest.hexdigest()[:16])


def take_requests(trace: Trace, n: int) -> Trace:
    """The same trace restricted to its first n requests (for the slow Python trees)."""
    if n >= trace.requests:
        return trace
    handoffs = [h for h in trace.handoffs if h.request < n]
    digest = hashlib.sha256(f"{trace.fingerprint}/{n}".encode()).hexdigest()[:16]
    return Trace(
        trace.config, trace.tokens[:n], trace.slots[:n], trace.prompt_len, handoffs, digest
    )


def take_gen(trace: Trace, max_gen: int) -> Trace:
    """The same trace cut at max_gen generated tokens (hand-offs past it dropped, last one cut)."""
    if max_gen >= trace.config.max_gen:
        return trace
    limit = trace.prompt_len + max_gen
    handoffs = []
    for h in trace.handoffs:
        if h.start >= limit:
            continue
        end = min(h.end, limit)
        step = end - trace.prompt_len - 1  # a cut hand-off moves to the last kept step
        handoffs.append(HandOff(step, h.request, h.start, end, h.bucket))
    handoffs.sort(key=lambda h: (h.step, h.request))
    tokens = [t[:limit] for t in trace.tokens]
    slots = [s[:limit] for s in trace.slots]
    config = TraceConfig(**{**trace.config.__dict__, "max_gen": max_gen})
    digest = hashlib.sha256(f"{trace.fingerprint}@{max_gen}".encode()).hexdigest()[:16]
    return Trace(config, tokens, slots, trace.prompt_len, handoffs, digest)
