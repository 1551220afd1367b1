"""Decode and catch-up step times of the paged model runner: eager vs CUDA graphs.

GPU (one prepared run, <= 5 minutes):  python benches/gpu/decode_step.py
CPU smoke test of every code path (tiny model, no timing claims):  ... --smoke --out DIR

Qwen3 shapes, random bf16 weights. Decode: every request attends over --context cached tokens
(random K/V in shuffled slots) and each timed step decodes one token per request into the same
slot, so the context stays constant. Catch-up: k requests x t new tokens at context L (the
routing engine's large-model forward). Shared decode (--shared-decode B x L / own [: K]): B
requests whose contexts share their first L - own slots with the others on the same of K system
prompts (round-robin; default 1), timed with the shared-prefix kernel (graphs: each prompt read
once for its rows) and without it (graphs-per-row: every row reads its whole list).
Paths:
  eager   Triton attention (split-KV decode kernel, varlen kernel for catch-ups), no graphs
  graphs  the same kernels replayed from CUDA graphs: decode steps (padded batch buckets) and
          catch-ups (extend_graphs.py: rows x tokens x q_width buckets)
  torch   the portable gather + SDPA attention, eager
  unfused eager without the Triton fusions of the elementwise chains (fused.py)
Each row: ms per step (CUDA events, median), host wall ms per step, tokens/s and the fraction of
the memory-bandwidth bound reached (weights + the batch's KV read once, at --bandwidth-gbs; a
shared prefix counted once per pass of the prefix kernel).
Before timing, graphs are checked against eager on an fp32 model (logits within 1e-4, identical
greedy tokens over 64 steps; catch-up graphs over rounds of catch-ups, likewise) and the Triton
catch-up path against the torch one. A model too large for fp32 is checked on its first
CHECK_LAYERS layers. Every row also records the forward's kernel launches per decoder layer
(tokencache_models.testing.launch_counter, counted on one eager call of that path's kernels).
Writes <device>-<date>.json to --out, else $OUT, else benches/gpu/results/ (GPU runs only).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))  # runs from a checkout without installing

from tokencache_models import (  # noqa: E402
    PRESETS,
    CausalLM,
    ForwardBatch,
    KVPool,
    TritonPagedAttention,
    find_prefix_groups,
    random_model,
)
from tokencache_models.config import ModelConfig  # noqa: E402
from tokencache_models.executor.decode_graphs import DecodeGraphRunner  # noqa: E402
from tokencache_models.executor.extend_graphs import ExtendGraphRunner  # noqa: E402
from tokencache_models.forward.context import HostBatch  # noqa: E402
from tokencache_models.shared_prefix.shape import PrefixShape  # noqa: E402

# The batch sizes the decode targets name: timed first, so a short budget still measures them.
TARGET_BATCHES = (1, 32)
# fp32 checks of a model over this many parameters use its first CHECK_LAYERS layers (a whole
# Qwen3-32B in fp32 does not fit beside its bf16 copy).
CHECK_FULL_PARAMS = 10e9
CHECK_LAYERS = 4

SMOKE_CONFIG = dataclasses.replace(
    PRESETS["qwen3-0.6b"],
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="qwen3-0.6b,qwen3-8b,qwen3-32b")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--paths", default="eager,graphs,torch,unfused")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument(
        "--catchups",
        default="1x10@8192,10x10@8192,4x10@8192,32x10@8192,1x10@2048,4x10@2048,10x10@2048,"
        "32x10@2048,10x15@2048",
        help="k x t @ L: k requests, t new tokens each, context L",
    )
    p.add_argument(
        "--shared-decode",
        default="32x2048/160,32x8192/160,32x8192/160:4",
        help="B x L / own [: K]: B decode requests of context L sharing all but their own last "
        "tokens with the others on the same of K prompts (default 1)",
    )
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--check-steps", type=int, default=64)
    p.add_argument("--bandwidth-gbs", type=float, default=4800.0, help="H200 HBM3e: 4.8 TB/s")
    p.add_argument(
        "--budget-s", type=float, default=270.0, help="start no row after (shared by the models)"
    )
    p.add_argument("--out", default=None, help="JSON file or directory")
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU, few steps")
    return p.parse_args(argv)


def parse_shared(spec: str) -> list[tuple[int, int, int, int]]:
    out = []
    for item in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)x(\d+)/(\d+)(?::(\d+))?", item.strip())
        if not m or not 1 <= int(m.group(3)) <= int(m.group(2)) or m.group(4) == "0":
            raise ValueError(
                f"bad shared-decode spec {item!r}; expected BxL/own[:K], 1 <= own <= L, K >= 1"
            )
        b, ctx, own = (int(g) for g in m.groups()[:3])
        out.append((b, ctx, own, int(m.group(4) or 1)))
    return out


def parse_catchups(spec: str) -> list[tuple[int, int, int]]:
    out = []
    for item in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)x(\d+)@(\d+)", item.strip())
        if not m:
            raise ValueError(f"bad catch-up spec {item!r}; expected KxT@L")
        k, t, ctx = (int(g) for g in m.groups())
        if t > ctx:
            raise ValueError(f"{item}: more new tokens than context")
        out.append((k, t, ctx))
    return out


def weight_bytes(model: CausalLM) -> int:
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # tied weights once
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    return KVPool.bytes_per_slot(config, dtype)


def decode_batch(bs: int, context: int, perm: torch.Tensor, vocab: int) -> ForwardBatch:
    """bs decode requests; request r owns perm[r*context:(r+1)*context], the last one new."""
    slots = perm[: bs * context].view(bs, context)
    return ForwardBatch(
        token_ids=torch.randint(0, vocab, (bs,), dtype=torch.int64),
        positions=torch.full((bs,), context - 1, dtype=torch.int64),
        out_slots=slots[:, -1].contiguous(),
        q_offsets=torch.arange(bs + 1, dtype=torch.int64),
        kv_slots=slots.reshape(-1).contiguous(),
        kv_offsets=torch.arange(bs + 1, dtype=torch.int64) * context,
    )


def shared_decode_batch(
    bs: int, context: int, own: int, perm: torch.Tensor, vocab: int, new: int = 1, prompts: int = 1
) -> ForwardBatch:
    """bs requests; request i's slot list starts with the context - own slots of prompt
    i % prompts, then own slots of its own, the last `new` of them new (1: a decode step; more:
    a catch-up)."""
    shared = context - own
    common = perm[: prompts * shared].view(prompts, shared)
    slots = perm[prompts * shared : prompts * shared + bs * own].view(bs, own)
    return ForwardBatch.from_requests(
        [torch.randint(0, vocab, (new,)) for _ in range(bs)],
        [torch.cat((common[i % prompts], s[:-new])) for i, s in enumerate(slots)],
        [s[-new:] for s in slots],
    )


def catchup_batch(k: int, t: int, context: int, perm: torch.Tensor, vocab: int) -> ForwardBatch:
    """k requests, each with context - t cached tokens and t new ones (scattered slots)."""
    slots = perm[: k * context].view(k, context)
    return ForwardBatch.from_requests(
        [torch.randint(0, vocab, (t,)) for _ in range(k)],
        [s[: context - t] for s in slots],
        [s[context - t :] for s in slots],
    )


def time_calls(fn: Callable[[], Any], warmup: int, iters: int, cuda: bool) -> tuple[float, float]:
    """(median device ms per call by CUDA events (host ms on CPU), host wall ms per call)."""
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    wall0 = time.perf_counter()
    for _ in range(iters):
        if cuda:
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    wall = (time.perf_counter() - wall0) * 1e3 / iters
    return statistics.median(times), wall


class Paths:
    """Runs one batch through a named path of one model."""

    def __init__(self, model: CausalLM, pool: KVPool, cuda: bool) -> None:
        self.model, self.pool, self.cuda = model, pool, cuda
        fast = "triton" if cuda else "torch"
        self.backend = {"eager": fast, "graphs": fast, "torch": "torch", "unfused": fast}
        self.backend["graphs-per-row"] = fast
        # On the CPU the graphs path is the static path without capture.
        self.static: DecodeGraphRunner | None = None
        self.static_extend: ExtendGraphRunner | None = None
        if not cuda:
            b = model.attention(fast)
            self.static = DecodeGraphRunner(
                model, pool, b, model.executor.decode_buckets, use_graphs=False
            )
            self.static_extend = ExtendGraphRunner(model, pool, b, use_graphs=False)

    def runner(self, kind: str = "decode") -> DecodeGraphRunner | ExtendGraphRunner | None:
        """The graph runner a row of `kind` ("decode", "catch-up") replays from."""
        attention = self.model.attention(self.backend["graphs"])
        if kind == "catch-up":
            if self.static_extend is not None:
                return self.static_extend
            return self.model.executor.extend_graph_runner(self.pool, attention)
        if self.static is not None:
            return self.static
        return self.model.executor.graph_runner(self.pool, attention)

    def call(self, path: str, batch: ForwardBatch) -> Callable[[], Any]:
        model, pool = self.model, self.pool
        backend = self.backend[path]
        if path == "graphs":
            hb = HostBatch.from_batch(batch)
            static = self.static if hb.is_decode else self.static_extend
            if static is not None and static.fits(hb):
                return lambda: static.run(HostBatch.from_batch(batch))

        attention = model.attention(backend)
        shares = attention.shares_prefix
        executor = model.executor

        def run() -> Any:
            executor.decode_graphs = executor.extend_graphs = path.startswith("graphs")
            model.fused = False if path == "unfused" else None
            attention.shares_prefix = shares and path != "graphs-per-row"
            try:
                return model(batch, pool, backend)
            finally:
                executor.decode_graphs = executor.extend_graphs = False
                model.fused = None
                attention.shares_prefix = shares

        return run


def bound_ms(wbytes: int, kv_tokens: int, kv_tok_bytes: int, gbs: float) -> float:
    return (wbytes + kv_tokens * kv_tok_bytes) / (gbs * 1e9) * 1e3


def check_graphs_vs_eager(
    config: ModelConfig,
    device: torch.device,
    steps: int,
    batch: int,
    prompt: int,
    cuda: bool,
    paths: tuple[str, str] = ("eager", "graphs"),
    shared: int = 0,
    systems: int = 1,
) -> dict[str, Any]:
    """fp32 model: greedy decode of `batch` requests for `steps` steps, paths[0] vs paths[1]
    (eager vs graphs; or graphs-per-row vs graphs, the shared-prefix kernel's check), each in
    its own pool from the same prefill; max |logit diff| over all steps and whether every greedy
    token agrees (each path feeds back its own tokens). shared: request i's prompt starts with
    the `shared` tokens of system prompt i % systems, whose slots its requests read."""
    model = random_model(config, device, torch.float32, seed=1, std=0.05)
    model.executor.decode_graphs = model.executor.extend_graphs = False
    g = torch.Generator().manual_seed(0)
    own = prompt - shared
    system = [torch.randint(0, config.vocab_size, (shared,), generator=g) for _ in range(systems)]
    prompts = [torch.randint(0, config.vocab_size, (own,), generator=g) for _ in range(batch)]
    sides: list[dict[str, Any]] = []
    for path in paths:
        pool = model.make_kv_pool(systems * shared + batch * (own + steps) + 8)
        common = [pool.alloc(shared) for _ in range(systems)]
        if shared:
            model(ForwardBatch.from_requests(system, [[]] * systems, common), pool, "torch")
        slots = [pool.alloc(own) for _ in range(batch)]
        prefixes = [common[i % systems] for i in range(batch)]
        out = model(ForwardBatch.from_requests(prompts, prefixes, slots), pool, "torch")
        slots = [torch.cat((c, s)) for c, s in zip(prefixes, slots, strict=True)]
        sides.append(
            {
                "path": path,
                "pool": pool,
                "paths": Paths(model, pool, cuda),
                "slots": slots,
                "tokens": out.logits.argmax(-1).tolist(),
            }
        )
    max_diff, same_tokens = compare_paths(sides, steps, 1, lambda s, _: [[t] for t in s["tokens"]])
    return {
        "check": f"{paths[1]} vs {paths[0]}, fp32"
        + (f", {systems} shared prompts of {shared} tokens" * bool(shared)),
        "batch": batch,
        "steps": steps,
        **verdict(max_diff, same_tokens, sides[1]["paths"].runner()),
    }


def compare_paths(
    sides: list[dict[str, Any]],
    rounds: int,
    new_tokens: int,
    inputs: Callable[[dict[str, Any], int], list[list[int]]],
) -> tuple[float, bool]:
    """`rounds` forwards on each side (its path, pool and slot lists; each request gets
    new_tokens slots, its tokens from inputs(side, round)), each side feeding back its own
    greedy tokens: the max |logit diff| between the two and whether every greedy token agrees."""
    max_diff, same_tokens = 0.0, True
    for r in range(rounds):
        logits = []
        for s in sides:
            new = [s["pool"].alloc(new_tokens) for _ in s["slots"]]
            fb = ForwardBatch.from_requests(inputs(s, r), s["slots"], new)
            out = s["paths"].call(s["path"], fb)()
            s["slots"] = [torch.cat((a, b)) for a, b in zip(s["slots"], new, strict=True)]
            s["tokens"] = out.logits.argmax(-1).tolist()
            logits.append(out.logits)
        max_diff = max(max_diff, (logits[0] - logits[1]).abs().max().item())
        same_tokens &= sides[0]["tokens"] == sides[1]["tokens"]
    return max_diff, same_tokens


def verdict(max_diff: float, same_tokens: bool, runner: Any) -> dict[str, Any]:
    """A graphs-vs-eager check's fields: fp32 logits within 1e-4 and the same greedy tokens."""
    return {
        "max_abs_logit_diff": max_diff,
        "greedy_tokens_identical": same_tokens,
        "graph_replays": runner.replays if runner is not None and runner.use_graphs else 0,
        "ok": max_diff <= 1e-4 and same_tokens,
    }


def check_extend_graphs_vs_eager(
    config: ModelConfig,
    device: torch.device,
    rounds: int,
    shape: tuple[int, int, int],
    cuda: bool,
) -> dict[str, Any]:
    """fp32 model: `rounds` rounds of catch-ups of k requests x t new tokens over contexts of
    about L tokens (shape (k, t, L); lengths staggered so rows differ), eager vs catch-up
    graphs, each in its own pool from the same prefill; each round's first token of a row is
    that path's own greedy token, the rest fixed. Max |logit diff| and whether every greedy
    token agrees."""
    k, t, ctx = shape
    model = random_model(config, device, torch.float32, seed=1, std=0.05)
    model.executor.decode_graphs = model.executor.extend_graphs = False
    g = torch.Generator().manual_seed(2)
    lens = [max(1, ctx - 7 * i) for i in range(k)]
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lens]
    tails = [
        [torch.randint(0, config.vocab_size, (t - 1,), generator=g).tolist() for _ in range(k)]
        for _ in range(rounds)
    ]
    sides: list[dict[str, Any]] = []
    for path in ("eager", "graphs"):
        pool = model.make_kv_pool(sum(lens) + k * t * rounds + 8)
        slots = [pool.alloc(n) for n in lens]
        for p, sl in zip(prompts, slots, strict=True):
            model(ForwardBatch.from_requests([p], [[]], [sl]), pool, "torch")
        sides.append({"path": path, "pool": pool, "paths": Paths(model, pool, cuda)})
        sides[-1].update(slots=slots, tokens=[0] * k)
    max_diff, same_tokens = compare_paths(
        sides,
        rounds,
        t,
        lambda s, r: [[first, *rest] for first, rest in zip(s["tokens"], tails[r], strict=True)],
    )
    return {
        "check": f"catch-up graphs vs eager, fp32, {k}x{t}@{ctx}",
        "rounds": rounds,
        **verdict(max_diff, same_tokens, sides[1]["paths"].runner("catch-up")),
    }


def launches_per_layer(model: CausalLM, fn: Callable[[], Any]) -> Any:
    """Kernel launches per decoder layer of one call of fn, a path's forward run eagerly (a
    graph replays the launches its eager body makes); None where the counter is missing."""
    try:
        from tokencache_models.testing.launch_counter import count_launches
    except ImportError:
        return None
    try:
        with count_launches(model.model.layers) as counter:
            fn()
        return counter.result.kernels_per_layer
    except Exception as e:  # the count is a side fact of the row: never its failure
        return f"{type(e).__name__}: {e}"[:100]


def check_catchup_paths(
    model: CausalLM, pool: KVPool, perm: torch.Tensor, spec: tuple[int, int, int]
) -> dict[str, Any]:
    k, t, ctx = spec
    batch = catchup_batch(k, t, ctx, perm, model.config.vocab_size)
    ref = model(batch, pool, "torch")
    fast = model(batch, pool, "triton" if model.device.type == "cuda" else "torch")
    return {
        "check": f"catch-up {k}x{t}@{ctx}: fast path vs torch path ({model.dtype})",
        "max_abs_logit_diff": (ref.logits - fast.logits).abs().max().item(),
        "argmax_equal": bool(torch.equal(ref.logits.argmax(-1), fast.logits.argmax(-1))),
    }


def check_shared_prefix(
    model: CausalLM, pool: KVPool, perm: torch.Tensor, spec: tuple[int, int, int], new: int
) -> dict[str, Any]:
    """A decode step (new = 1) or a catch-up (new tokens per request) over a shared prefix, in
    the bench's dtype: the shared-prefix path's logits against every row reading its whole
    slot list (the same kernels otherwise) and both against the torch path. ok: the prefix
    path is no further from torch than the per-row path is (twice that, plus 1e-3 of the
    logits' scale: bf16 rounds differently along each path, so no absolute tolerance fits)."""
    bs, ctx, own, prompts = spec
    batch = shared_decode_batch(bs, ctx, own, perm, model.config.vocab_size, new, prompts)
    fast = model.attention("triton" if model.device.type == "cuda" else "torch")
    shares = fast.shares_prefix
    outs = []
    for on in (True, False):
        fast.shares_prefix = shares and on
        outs.append(model(batch, pool, fast.name).logits.float())
    fast.shares_prefix = shares
    ref = model(batch, pool, "torch").logits.float()
    prefix_err = (outs[0] - ref).abs().max().item()
    per_row_err = (outs[1] - ref).abs().max().item()
    kind = "decode" if new == 1 else f"catch-up x{new}"
    spec_s = f"{bs}x{ctx}/{own}" + (f":{prompts}" if prompts > 1 else "")
    return {
        "check": f"shared {kind} {spec_s}: prefix path vs per-row, torch ({model.dtype})",
        "max_abs_logit_diff_per_row": (outs[0] - outs[1]).abs().max().item(),
        "max_abs_logit_diff_torch": prefix_err,
        "per_row_max_abs_logit_diff_torch": per_row_err,
        "argmax_equal_torch": bool(torch.equal(outs[0].argmax(-1), ref.argmax(-1))),
        "ok": prefix_err <= 2 * per_row_err + 1e-3 * ref.abs().max().item(),
    }


def bench_model(
    name: str,
    config: ModelConfig,
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
    deadline: float,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rows of one model, the issue's target rows first (decode at batch 1 and 32, then the
    catch-ups, then the other batch sizes), none started after `deadline` (monotonic)."""
    cuda = device.type == "cuda"
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    catchups = parse_catchups(args.catchups)
    shared_specs = parse_shared(args.shared_decode)
    model = random_model(config, device, dtype, seed=0)
    model.executor.decode_graphs = model.executor.extend_graphs = False
    kvb = kv_bytes_per_token(config, dtype)
    if cuda:  # rows whose KV does not fit beside the weights are left out (Qwen3-32B's b=256)
        room = int(0.8 * torch.cuda.mem_get_info()[0]) // kvb
        sizes = [b for b in sizes if b * args.context <= room]
        catchups = [c for c in catchups if c[0] * c[2] <= room]
        shared_specs = [x for x in shared_specs if x[3] * (x[1] - x[2]) + x[0] * x[2] <= room]
    need = max(
        [max(sizes, default=1) * args.context]
        + [k * c for k, _, c in catchups]
        + [k * (ctx - own) + b * own for b, ctx, own, k in shared_specs]
    )
    pool = KVPool.for_config(config, need, device, dtype)
    pool.k_store.normal_()
    pool.v_store.normal_()
    perm = torch.randperm(pool.num_slots)  # scattered slots, as a paged cache would be
    paths = Paths(model, pool, cuda)
    wbytes = weight_bytes(model)
    rows: list[dict[str, Any]] = []
    checks = [check_catchup_paths(model, pool, perm, catchups[0])] if catchups else []
    if shared_specs:
        # A decode step and a catch-up of 10 tokens each (the varlen kernel's skipping path),
        # then both over two prompts (two groups).
        bs, ctx, own, _ = shared_specs[0]
        for prompts in (1, 2):
            spec = (bs, ctx, own, prompts)
            checks.append(check_shared_prefix(model, pool, perm, spec, 1))
            checks.append(
                check_shared_prefix(model, pool, perm, (bs, ctx, max(own, 11), prompts), 10)
            )

    def timed(
        row: dict[str, Any],
        fn: Callable[[], Any],
        tokens: int,
        kv_tokens: int,
        eager: Callable[[], Any] | None = None,
    ) -> None:
        """eager: the same forward without graphs, for the launch count of a graphs row."""
        row["kv_tokens"] = kv_tokens  # KV slots the step reads at least (what the clock fits)
        if time.monotonic() > deadline:
            row["skipped"] = "time budget"
        else:
            graphed = row["path"].startswith("graphs")
            runner = paths.runner(row["kind"]) if graphed else None
            before = runner.replays if runner is not None else 0
            try:
                ms, wall = time_calls(fn, args.warmup, args.iters, cuda)
                bound = bound_ms(wbytes, kv_tokens, kvb, args.bandwidth_gbs)
                row.update(
                    step_ms=ms,
                    wall_ms=wall,
                    tokens_per_s=tokens / ms * 1e3,
                    bound_ms=bound,
                    bound_fraction=bound / ms,
                )
                runner = paths.runner(row["kind"]) if graphed else None
                if runner is not None and runner.use_graphs:
                    row["graph_replays"] = runner.replays - before
                row["launches_per_layer"] = launches_per_layer(model, eager or fn)
            except Exception as e:  # record OOM / compile errors and go on
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                if cuda:
                    torch.cuda.empty_cache()
        rows.append(row)
        print(json.dumps(row), flush=True)

    def decode(bs: int) -> None:
        batch = decode_batch(bs, args.context, perm, config.vocab_size)
        for path in args.paths.split(","):
            row = {"model": name, "kind": "decode", "path": path, "batch": bs}
            row["context"] = args.context
            eager = paths.call("eager", batch) if path == "graphs" else None
            timed(row, paths.call(path, batch), bs, bs * args.context, eager)

    def catch_up(k: int, t: int, ctx: int) -> None:
        batch = catchup_batch(k, t, ctx, perm, config.vocab_size)
        for path in args.paths.split(","):
            row = {"model": name, "kind": "catch-up", "path": path, "batch": k, "context": ctx}
            row["new_tokens"] = t
            eager = paths.call("eager", batch) if path == "graphs" else None
            timed(row, paths.call(path, batch), k * t, k * ctx, eager)

    def shared_decode(bs: int, ctx: int, own: int, prompts: int) -> None:
        batch = shared_decode_batch(bs, ctx, own, perm, config.vocab_size, prompts=prompts)
        hb = HostBatch.from_batch(batch)
        groups = find_prefix_groups(hb.kv_slots, batch.kv_offsets.numpy(), hb.q_offsets)
        # The least KV a step must read: each row's own slots, each prompt once per pass of
        # the prefix kernel over its rows.
        shape = PrefixShape.of(config, dtype.itemsize)
        skipped = sum(len(g.rows) * g.length for g in groups)
        once = sum(g.length * shape.passes(len(g.rows)) for g in groups)
        kv_read = bs * ctx - skipped + once
        shared = max((g.length for g in groups), default=0)
        for path in ("graphs", "graphs-per-row"):
            if "graphs" not in args.paths.split(","):
                break
            row = {"model": name, "kind": "shared decode", "path": path, "batch": bs}
            row.update(context=ctx, shared=shared, prompts=prompts)
            # The bound: the least either path could read; the fit: what this path reads.
            timed(row, paths.call(path, batch), bs, kv_read)
            if path == "graphs-per-row":
                row["kv_tokens"] = bs * ctx

    first = [bs for bs in TARGET_BATCHES if bs in sizes]
    for bs in first:
        decode(bs)
    for spec in catchups:
        catch_up(*spec)
    for shared_spec in shared_specs:
        shared_decode(*shared_spec)
    for bs in sizes:
        if bs not in first:
            decode(bs)
    kinds = ("decode", "shared decode", "catch-up")
    rows.sort(key=lambda r: (kinds.index(r["kind"]), r["batch"], r.get("context", 0)))
    return rows, checks


def markdown(rows: list[dict[str, Any]], title: str) -> str:
    lines = [f"## {title}", "", "| model | kind | path | batch | context | step ms | host ms |"]
    lines[-1] += " tokens/s | bound ms | of bound | launches / layer |"
    lines.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        kind = r["kind"] + (f" x{r['new_tokens']}" if "new_tokens" in r else "")
        kind += f", {r['prompts']} prompts" if r.get("prompts", 1) > 1 else ""
        head = f"| {r['model']} | {kind} | {r['path']} | {r['batch']} | {r['context']} |"
        if "step_ms" in r:
            lines.append(
                f"{head} {r['step_ms']:.2f} | {r['wall_ms']:.2f} | {r['tokens_per_s']:.0f} |"
                f" {r['bound_ms']:.2f} | {r['bound_fraction']:.2f} |"
                f" {r.get('launches_per_layer') or '-'} |"
            )
        else:
            lines.append(f"{head} {(r.get('skipped') or r.get('error', '?'))[:40]} | | | | | |")
    return "\n".join(lines)


def checkable(config: ModelConfig) -> ModelConfig:
    """The model the fp32 checks build: the whole model, or its first CHECK_LAYERS layers when
    it is too large to hold in fp32 beside the benchmark's bf16 model."""
    h, d = config.hidden_size, config.head_dim
    attn = h * d * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    layer = attn + 3 * h * config.intermediate_size
    if config.num_hidden_layers * layer + config.vocab_size * h <= CHECK_FULL_PARAMS:
        return config
    return dataclasses.replace(config, num_hidden_layers=CHECK_LAYERS)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        args.models = "smoke"
        args.batch_sizes, args.context = "1,3,4", 40
        args.catchups, args.warmup, args.iters = "2x3@40,1x5@70", 1, 2
        args.shared_decode = "3x40/4,4x40/4:2"
        args.check_steps = min(args.check_steps, 6)
        args.paths = "eager,graphs,torch,unfused"
    elif not torch.cuda.is_available():
        print(
            "decode_step.py: no CUDA device found; this benchmark needs a GPU (--smoke runs "
            "its code paths on the CPU).",
            file=sys.stderr,
        )
        return 2
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
    t0 = time.monotonic()
    cuda = device.type == "cuda"
    name0 = args.models.split(",")[0]
    check_cfg = SMOKE_CONFIG if args.smoke else checkable(PRESETS[name0])
    checks = [check_graphs_vs_eager(check_cfg, device, args.check_steps, 8, 64, cuda)]
    # Catch-up graphs against eager: a catch-up like the routing engine's, then a prefill-like
    # chunk (one row, many tokens), each over several rounds.
    rounds = 3 if args.smoke else 8
    for shape in ((3, 4, 30), (1, 20, 40)) if args.smoke else ((10, 10, 512), (1, 100, 256)):
        checks.append(check_extend_graphs_vs_eager(check_cfg, device, rounds, shape, cuda))
    # The shared-prefix kernel against every row reading its whole list (graphs both), over
    # two system prompts (two groups).
    shared = 256 if not args.smoke else 8
    per_row = ("graphs-per-row", "graphs")
    checks.append(
        check_graphs_vs_eager(
            check_cfg, device, args.check_steps, 8, shared + 8, cuda, per_row, shared, 2
        )
    )
    for c in checks:
        print(json.dumps(c), flush=True)
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    rows: list[dict[str, Any]] = []
    names = args.models.split(",")
    for i, name in enumerate(names):
        config = SMOKE_CONFIG if args.smoke else PRESETS[name]
        # Each model gets an equal share of what is left of the budget.
        left = args.budget_s - (time.monotonic() - t0)
        deadline = time.monotonic() + left / (len(names) - i)
        r, c = bench_model(name, config, args, device, dtype, deadline)
        rows += r
        checks += c
        gc.collect()  # model <-> graph runner cycles hold the pool and the graphs' memory
        if cuda:
            torch.cuda.empty_cache()
    dev_name = torch.cuda.get_device_name() if cuda else "cpu-smoke"
    title = f"Decode and catch-up steps, {dtype}, {dev_name}"
    print("\n" + markdown(rows, title) + "\n\nChecks: " + json.dumps(checks))
    result = {
        "device": dev_name,
        "torch": torch.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "bandwidth_gbs": args.bandwidth_gbs,
        # Whether the fast paths read a shared prefix once (GpuClock.fit reads this).
        "shared_prefix_attention": cuda and TritonPagedAttention().shares_prefix,
        "smoke": args.smoke,
        "rows": rows,
        "checks": checks,
        "wall_s": time.monotonic() - t0,
    }
    out = Path(args.out) if args.out else None
    if out is None and cuda:  # $OUT is what comes back from the device machine
        out = Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "benches/gpu/results"
    if out is not None:
        if out.suffix != ".json":
            slug = re.sub(r"[^a-z0-9]+", "-", dev_name.lower()).strip("-")
            out = out / f"{slug}-{datetime.date.today().isoformat()}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        print(f"wrote {out}")
    return 0 if all(c.get("ok", True) for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
