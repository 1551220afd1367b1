"""Host milliseconds per decode step of the routing engine, at serving batch sizes and contexts.

What counts as device work: CausalLM.execute, the forward body (or a CUDA graph's replay) after
the runner's host preparation. Here it is replaced by a stub that returns zero logits at once,
so the engine's whole host path runs for real at any batch and context on this CPU: the
scheduler, prepare_forward and the slot table, the runner's preparation (HostBatch, padding,
shared-prefix groups and tile tables, the copy into the step's buffers), sampling, the router,
the commits and the trees, and the event loop's work between steps (intake, aborts,
admission). Host time is this thread's CPU time of each step minus the stub's
(the engine's own accounting: Stats.small_host_s, EngineConfig(host_charge=...)), so other
processes on a shared machine do not inflate it.

`--runner gpu` prepares what the GPU runner does (Triton backend's shared-prefix tables,
decode padding to a bucket, the static buffers of the graph runner, no capture); `eager` is
the CPU serving path (torch backend). Every request decodes behind one shared prompt (the
prompt is the context, less 16 tokens of its own), greedy, with a router that never escalates;
the catch-up row times the large model's step over 10 requests x 10 new tokens each.
`--escalate 0.1` adds decode rows under a router escalating a tenth of the tokens (catch-ups
of a quarter of the batch): what serving sees, rows leaving and rejoining the batch, so a
step seldom goes on in place; every small step is timed (their mean rows in the table).

    python benches/host_path.py                      # batch 1 32 128 256 x context 2k 8k 32k
    python benches/host_path.py --batches 32 --contexts 2048 8192 --steps 20 --json out.json
    python benches/host_path.py --batches 32 --contexts 8192 --overlap on --phases  # by phase
    python benches/host_path.py --batches 32 --contexts 8192 --escalate 0 0.1   # routing, too

Prints a table of medians (and writes JSON with --json). `--overlap on off` (default both):
with overlap the engine prepares step n+1 while the GPU runs step n, so the host time per step
is about the same but the GPU waits only for what exceeds its own step: the "GPU idle" column
is the engine clock's (Stats.device_idle_s over idle + the step's device price), serially all
of the host time, with overlap max(0, host - device) per step.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

_INTEGRATIONS = Path(__file__).resolve().parents[1] / "integrations"
if str(_INTEGRATIONS) not in sys.path:
    sys.path.insert(0, str(_INTEGRATIONS))

import torch  # noqa: E402

from tokencache_models import (  # noqa: E402
    ModelConfig,
    random_model,
)
from tokencache_models.testing.stubbed_device import stub_execute  # noqa: E402
from tokencache_routing import (  # noqa: E402
    BernoulliRouter,
    EngineConfig,
    EntropyRouter,
    RoutedEngine,
    SchedulerConfig,
)
from tokencache_routing.core.routers import ScriptedRouter  # noqa: E402
from tokencache_routing.sim.clock import GpuClock  # noqa: E402

CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=65536,
)
OWN_TOKENS = 16  # each request's own tokens after the shared prompt


@dataclass
class Row:
    kind: str  # "decode" or "catch-up"
    runner: str
    overlap: bool
    batch: int
    context: int
    host_ms: float  # median host ms per step
    host_ms_min: float
    host_ms_max: float
    device_ms: float  # the GPU clock's price of the same step (Qwen3-0.6B / 8B, h200-roofline)
    gpu_idle_share: float  # idle / (idle + device): what the GPU waits for (Stats.device_idle_s)
    # --escalate: the share of tokens a Bernoulli router escalates (0: it never does) and then
    # the mean rows of the small steps timed (every one is: rows leave and rejoin).
    escalate: float = 0.0
    mean_rows: float | None = None
    # Python function calls per step (--calls: a second, profiled pass over the same shape):
    # the interpreter's share of the host work, counted, so the same on any machine.
    calls_per_step: float | None = None


def _engine(
    batch: int,
    context: int,
    runner: str,
    router: Any,
    new_tokens: int,
    catchup_batch: int = 1,
    overlap: bool = True,
) -> RoutedEngine:
    small = stub_execute(random_model(CONFIG, seed=1), runner)
    large = stub_execute(random_model(CONFIG, seed=2), runner)
    # Room for every request's whole generation: a pool that runs dry evicts and preempts,
    # and the steps timed would then be the full-batch ones before it did.
    slots = context + batch * (OWN_TOKENS + new_tokens + 16) + 1024
    return RoutedEngine(
        small,
        large,
        router,
        config=EngineConfig(
            num_slots=slots,
            scheduler=SchedulerConfig(
                max_running=batch, min_large_batch=catchup_batch, max_wait_steps=1000
            ),
            clock=GpuClock(profile="h200-roofline"),
            overlap=overlap,
        ),
    )


def _prompts(batch: int, context: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(context)
    shared = torch.randint(0, CONFIG.vocab_size, (context - OWN_TOKENS,), generator=g).tolist()
    own = torch.randint(0, CONFIG.vocab_size, (batch, OWN_TOKENS), generator=g).tolist()
    return [shared + o for o in own]


def _decoding(
    batch: int, context: int, runner: str, steps: int, overlap: bool, escalate: float = 0.0
) -> RoutedEngine:
    """An engine whose batch has prefilled and taken a first decode step. escalate > 0: a
    router escalating that share of tokens (BernoulliRouter), catch-ups of a quarter of the
    batch: rows leave the small batch and rejoin it, as in serving, where a step seldom
    goes on in place."""
    new = steps + 8
    if escalate > 0:
        router: Any = BernoulliRouter(escalate, seed=context + batch)
        catchup = max(1, batch // 4)
    else:
        router, catchup = EntropyRouter(math.inf), 1
    eng = _engine(batch, context, runner, router, new, catchup, overlap=overlap)
    handles = [eng.submit(p, max_new_tokens=new) for p in _prompts(batch, context)]
    while any(len(h.tokens) < 2 for h in handles):  # prefills and a first decode step
        eng.iterate()
    return eng


def calls_per_step(
    batch: int, context: int, runner: str, steps: int, overlap: bool, escalate: float = 0.0
) -> float:
    """Python function calls (cProfile's count, C functions included) per decode step: a
    deterministic measure of the interpreter's work where the CPU time is noisy (a shared
    machine, a VM with busy neighbours). The clock's pricing counts too (it is not host
    time), the same in any version that prices alike. With escalations the catch-ups'
    calls count too."""
    eng = _decoding(batch, context, runner, steps, overlap, escalate)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        eng.iterate()
    profile.disable()
    eng.shutdown()
    return pstats.Stats(profile).total_calls / steps  # type: ignore[attr-defined]


# The phases --phases times: (label, module, qualified name), outermost first. Inclusive times,
# each call wrapped with two thread_time reads (the wrappers add to what they time: read the
# shares, not the sums).
PHASES = (
    ("schedule_small", "tokencache_routing.core.batch_planning", "BatchPlanning.schedule_small"),
    ("  _plan", "tokencache_routing.core.batch_planning", "BatchPlanning._plan"),
    ("  prepare_forward", "tokencache_routing.core.batch_planning", "prepare_forward"),
    ("runner preparation", "tokencache_models.model", "CausalLM.prepare"),
    (
        "  prefix tables",
        "tokencache_models.executor.decode_graphs",
        "DecodeGraphRunner._prefix_tables",
    ),
    ("  buffers", "tokencache_models.executor.decode_graphs", "DecodeGraphRunner._load"),
    ("draw", "tokencache_routing.core.batch", "draw"),
    ("route", "tokencache_routing.core.batch", "route"),
    ("finish_small", "tokencache_routing.core.forward_finishing", "ForwardFinishing.finish_small"),
    ("  commit", "tokencache_routing.core.batch", "PreparedForward.commit"),
    ("  read-backs", "tokencache_routing.core.sampling", "Decisions.resolve"),
    ("  read-backs", "tokencache_routing.core.sampling", "Draw.resolve"),
    ("intake, aborts, admission", "tokencache_routing.engine", "RoutedEngine.intake"),
    (
        "intake, aborts, admission",
        "tokencache_routing.core.request_lists",
        "RequestLists.apply_aborts",
    ),
    ("intake, aborts, admission", "tokencache_routing.core.admission", "Admission.admit"),
)


def phases_per_step(
    batch: int, context: int, runner: str, steps: int, overlap: bool, escalate: float = 0.0
) -> tuple[float, dict[str, float]]:
    """Host ms per step and each phase's inclusive ms per step (PHASES), the phases' calls
    wrapped with this thread's CPU timer: where a step's host time goes, by share. With
    escalations the phases shared with catch-ups (the runner's preparation, the commit) hold
    the catch-ups' work too, which the host figure (small steps only) does not."""
    import functools
    import importlib

    spent: dict[str, float] = {}
    undo: list[tuple[Any, str, Any]] = []

    def wrap(label: str, module: str, name: str) -> None:
        owner: Any = importlib.import_module(module)
        *path, attr = name.split(".")
        for part in path:
            owner = getattr(owner, part)
        inner = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)

        @functools.wraps(inner)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0.0) + time.thread_time() - t0

        undo.append((owner, attr, inner))
        setattr(owner, attr, timed)

    eng = _decoding(batch, context, runner, steps, overlap, escalate)
    try:
        for phase in PHASES:
            wrap(*phase)
        h0 = eng.stats.small_host_s
        for _ in range(steps):
            eng.iterate()
        host = (eng.stats.small_host_s - h0) / steps
    finally:
        for owner, attr, inner in reversed(undo):
            setattr(owner, attr, inner)
        eng.shutdown()
    labels = dict.fromkeys(label for label, _, _ in PHASES)  # in PHASES' order
    return host * 1e3, {k: spent.get(k, 0.0) / steps * 1e3 for k in labels}


def decode_row(
    batch: int,
    context: int,
    runner: str,
    steps: int,
    overlap: bool = True,
    escalate: float = 0.0,
) -> Row:
    """The small steps of `steps` iterations: at full batch (escalate 0), or every one (rows
    come and go: their mean is recorded). A catch-up's host time is not a small step's."""
    eng = _decoding(batch, context, runner, steps, overlap, escalate)
    st = eng.stats
    host, device, idle, rows = [], [], [], []
    for _ in range(steps):
        h0, d0, i0 = st.small_host_s, st.small_device_s, st.device_idle_s
        n0 = len(st.small_batch_sizes)
        eng.iterate()
        if len(st.small_batch_sizes) == n0 + 1 and (escalate or st.small_batch_sizes[-1] == batch):
            host.append(st.small_host_s - h0)
            device.append(st.small_device_s - d0)
            idle.append(st.device_idle_s - i0)
            rows.append(st.small_batch_sizes[-1])
    eng.shutdown()
    row = _row("decode", runner, overlap, batch, context, host, device, idle)
    if escalate:
        row.escalate, row.mean_rows = escalate, statistics.mean(rows)
    return row


def catchup_row(
    context: int, runner: str, rounds: int, requests: int = 10, overlap: bool = True
) -> Row:
    """The large model's catch-up over `requests` requests x 10 new tokens: every request
    escalates at generated positions 0 (the first catch-up prefills its prompt) and then every
    10th; the later catch-ups are timed."""
    router = ScriptedRouter(default=range(0, 10 * (rounds + 1) + 1, 10))
    new = 10 * (rounds + 1) + 2
    eng = _engine(requests, context, runner, router, new, catchup_batch=requests, overlap=overlap)
    handles = [eng.submit(p, new) for p in _prompts(requests, context)]
    st = eng.stats
    host, device = [], []
    first = True
    while not all(h.done() for h in handles):
        n0, h0, s0 = len(st.catchup_batch_sizes), st.host_s, st.small_host_s
        t0 = eng.now()
        eng.iterate()
        if len(st.catchup_batch_sizes) == n0 + 1 and st.catchup_batch_sizes[-1] == requests:
            if first:
                first = False  # the prompt's prefill into the large model
                continue
            if st.catchup_tokens[-1] >= 9 * requests:
                large_host = (st.host_s - h0) - (st.small_host_s - s0)
                host.append(large_host)
                # The clock advanced by the catch-up (serial) and maybe a small step after it.
                device.append(max(eng.now() - t0 - (st.host_s - h0), 0.0))
    eng.shutdown()
    # A catch-up stalls the small model on one device: the GPU waits for all its host time.
    return _row("catch-up", runner, overlap, requests, context, host, device, host)


def _row(
    kind: str,
    runner: str,
    overlap: bool,
    batch: int,
    context: int,
    host: list[float],
    device: list[float],
    idle: list[float],
) -> Row:
    if not host:
        raise RuntimeError(f"no {kind} step of batch {batch} was measured")
    h = statistics.median(host) * 1e3
    d = statistics.median(device) * 1e3
    i = statistics.median(idle) * 1e3
    return Row(
        kind,
        runner,
        overlap,
        batch,
        context,
        h,
        min(host) * 1e3,
        max(host) * 1e3,
        d,
        i / (i + d) if i + d else 0.0,
    )


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256])
    ap.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--runner", choices=("gpu", "eager"), nargs="+", default=["gpu"])
    ap.add_argument("--steps", type=int, default=30, help="timed decode steps per shape")
    ap.add_argument("--catchup-rounds", type=int, default=3)
    ap.add_argument(
        "--escalate", type=float, nargs="+", default=[0.0],
        help="decode rows with a router escalating this share of tokens (0: never; e.g. 0.1)",
    )  # fmt: skip
    ap.add_argument(
        "--overlap", choices=("on", "off"), nargs="+", default=["on", "off"],
        help="the engine's overlapped scheduling (EngineConfig(overlap=...))",
    )  # fmt: skip
    ap.add_argument(
        "--calls", action="store_true",
        help="also count Python calls per decode step (a profiled second pass per shape)",
    )  # fmt: skip
    ap.add_argument(
        "--phases", action="store_true",
        help="also time each phase of a decode step (a wrapped second pass per shape)",
    )  # fmt: skip
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    # The host path is one thread; torch's intra-op pool on a shared 2-core machine would
    # turn a [batch, vocab] softmax into milliseconds of spinning. Restored on return: a
    # caller's process (the tests) keeps its own setting.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> list[Row]:
    try:
        from tqdm import tqdm
    except ImportError:  # the progress bar is optional

        def tqdm(x: Any, **_: Any) -> Any:
            return x

    overlaps = [o == "on" for o in args.overlap]
    if any(not 0 <= p < 1 for p in args.escalate):
        raise SystemExit(f"--escalate takes shares in [0, 1), got {args.escalate}")
    shapes = [
        (r, o, b, c, p)
        for r in args.runner
        for o in overlaps
        for p in args.escalate
        for c in args.contexts
        for b in args.batches
    ]
    rows: list[Row] = []
    t0 = time.perf_counter()
    for runner, o, b, c, p in tqdm(shapes, desc="decode shapes"):
        row = decode_row(b, c, runner, args.steps, o, p)
        if args.calls:
            row.calls_per_step = calls_per_step(b, c, runner, min(args.steps, 20), o, p)
        rows.append(row)
    if args.phases:
        for runner, o, b, c, p in shapes:
            host, spent = phases_per_step(b, c, runner, args.steps, o, p)
            escalating = f", escalating {p:g} (catch-ups' work in shared phases)" if p else ""
            print(
                f"phases, {runner} runner, overlap {'on' if o else 'off'}, batch {b}, context "
                f"{c}{escalating}: host {host:.3f} ms a step with the wrappers; inclusive ms "
                "(share):"
            )
            for label, ms in spent.items():
                print(f"  {label:28s} {ms:.3f} ({100 * ms / host:.0f}%)")
    for runner in args.runner if args.catchup_rounds > 0 else ():
        for c in tqdm(args.contexts, desc=f"catch-ups ({runner})"):
            rows.append(catchup_row(c, runner, args.catchup_rounds, overlap=overlaps[0]))
    calls = " calls / step |" if args.calls else ""
    print(
        "| step | runner | overlap | batch | context | host ms (median) | min | max | GPU ms "
        f"| GPU idle |{calls}"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|" if args.calls else ""))
    for r in rows:
        counted = ""
        if args.calls:
            counted = " - |" if r.calls_per_step is None else f" {r.calls_per_step:.0f} |"
        step = r.kind if not r.escalate else f"{r.kind}, p={r.escalate:g} ({r.mean_rows:.1f} rows)"
        print(
            f"| {step} | {r.runner} | {'on' if r.overlap else 'off'} | {r.batch} | {r.context} "
            f"| {r.host_ms:.3f} | "
            f"{r.host_ms_min:.3f} | {r.host_ms_max:.3f} | {r.device_ms:.3f} | "
            f"{100 * r.gpu_idle_share:.0f}% |{counted}"
        )
    took = time.perf_counter() - t0
    print(f"({took:.0f} s; host: this thread's CPU time per step less the stubbed device work)")
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1))
    return rows


if __name__ == "__main__":
    main()
