"""Tensor parallelism (tokencache_models.parallel): TP=2 against TP=1, on CPU over gloo.

Each multi-process case runs in a driver subprocess (this file as a script) that launches one
worker rank on 127.0.0.1 and compares its TP=2 model with the same weights unsharded in the same
process: fp32 logits within 1e-5 at every forward and identical greedy tokens, over a ragged
list-mode run (prefill, shared prefixes, extends, decode) and an engine-like slot-table run
(admissions over another request's slots, table growth, row reuse, a prepared step dropped
before it ran), then a routed generation through tokencache_routing's RoutedEngine with the TP
model as its large one (random escalations, batched catch-ups, a shared prefix; the llama case
in the threaded driver) token for token and model for model.
Every subprocess is bounded by a timeout; the worker is a daemon of its driver.
The kill cases check that a worker dying (idle, or inside a forward's all-reduce) makes the
driver raise TPWorkerLost within a few seconds and that nothing is left running.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "integrations"))

from tokencache_models import (  # noqa: E402
    CausalLM,
    ForwardBatch,
    GreedyRunner,
    HostBatch,
    KVPool,
    ModelConfig,
    PrefixGroup,
    SlotTable,
    random_model,
)
from tokencache_models.parallel.runtime import (  # noqa: E402
    HEADER,
    MirrorTable,
    ShardOf,
    TPSlotTable,
    TPWorkerLost,
    decode_forward,
    encode_forward,
    launch,
)
from tokencache_models.parallel.sharding import shard_model  # noqa: E402
from tokencache_models.parallel.tp_layers import (  # noqa: E402
    TPGroup,
    check_divisible,
    kv_head_of,
    shard_config,
    vocab_shard,
)

TOL = 1e-5
CONFIGS: dict[str, ModelConfig] = {
    # q/k norms, tied head, head_dim != hidden / heads
    "qwen3": ModelConfig(
        model_type="qwen3",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),
    # q/k/v biases, untied, an odd vocabulary (the second shard holds a padding row)
    "qwen2": ModelConfig(
        model_type="qwen2",
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    ),
    # GQA 4 (each rank one KV head), llama3 RoPE scaling
    "llama": ModelConfig(
        model_type="llama",
        vocab_size=100,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=4,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


def full_model(family: str) -> CausalLM:
    return random_model(CONFIGS[family], seed=7, std=0.3, attention_backend="torch")


# -- the scenarios (run on the TP model and on the unsharded one) ---------------------------


def list_scenario(model: CausalLM, pool: KVPool) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Ragged ForwardBatch forwards: a prefill, then a prefix-sharing extend beside a decode
    and a fresh prefill, a multi-token extend (a catch-up), then greedy decode."""
    g = GreedyRunner(model, pool)
    logits = []
    a = g.add_request([3, 14, 15, 92, 65, 35, 8])
    logits.append(g.step([a]).logits)
    b = g.add_request([3, 14, 15, 92, 65, 1, 2], share_from=a, shared_len=5)
    c = g.add_request([9, 9, 8])
    logits.append(g.step([a, b, c]).logits)
    g.extend(a, [4, 5, 6])
    logits.append(g.step([a, b]).logits)
    for _ in range(6):
        logits.append(g.step([a, b, c]).logits)
    return logits, [g.requests[r].tokens for r in (a, b, c)]


def table_scenario(
    model: CausalLM, pool: KVPool, table: SlotTable, drop_one: bool
) -> tuple[list[torch.Tensor], list[list[int]]]:
    """The engine's way: slot-table rows written at admission (here over another request's
    prefix slots), appended per forward with one scatter; the table starts 2 x 4 so it grows
    in rows and width; a finished request's row is reused; drop_one prepares a forward and drops
    it before it runs (its writes must still reach the workers)."""
    logits: list[torch.Tensor] = []
    reqs: dict[str, dict[str, Any]] = {}

    def admit(name: str, prompt: list[int], share: str | None = None, k: int = 0) -> None:
        row = table.acquire()
        matched = reqs[share]["slots"][:k] if share else np.zeros(0, np.int64)
        table.write(row, 0, matched)
        reqs[name] = {
            "row": row,
            "tokens": list(prompt),
            "slots": matched.copy(),
            "todo": prompt[k:],
        }

    def forward(names: list[str]) -> None:
        rs = [reqs[n] for n in names]
        q_lens = np.array([len(r["todo"]) for r in rs], np.int64)
        new = pool.allocator.alloc_array(int(q_lens.sum()))
        q_off = np.concatenate(([0], np.cumsum(q_lens)))
        rows, positions, toks = [], [], []
        for i, r in enumerate(rs):
            n0 = len(r["slots"])
            r["slots"] = np.concatenate((r["slots"], new[q_off[i] : q_off[i + 1]]))
            rows += [r["row"]] * int(q_lens[i])
            positions += list(range(n0, n0 + int(q_lens[i])))
            toks += r["todo"]
        table.scatter(np.array(rows, np.int64), np.array(positions, np.int64), new)
        kv_lens = np.array([len(r["slots"]) for r in rs], np.int64)
        hb = HostBatch.from_table(
            table,
            np.array([r["row"] for r in rs], np.int64),
            np.array(toks, np.int64),
            np.array(positions, np.int64),
            new,
            q_off.astype(np.int64),
            kv_lens,
        )
        out = model.execute(model.prepare(hb, pool))
        logits.append(out.logits)
        for r, nxt in zip(rs, out.logits.argmax(-1).tolist(), strict=True):
            r["tokens"].append(nxt)
            r["todo"] = [nxt]

    admit("a", [5, 6, 7, 8, 9, 10])
    forward(["a"])
    admit("b", [5, 6, 7, 8, 9, 11, 12], share="a", k=5)
    forward(["a", "b"])
    admit("c", [40, 41, 42, 43, 44, 45, 46, 47, 48])  # a third row: the rows double
    for _ in range(3):
        forward(["a", "b", "c"])
    reqs["b"]["todo"] = reqs["b"]["todo"] + [3, 4, 5]  # a catch-up of several tokens
    reqs["b"]["tokens"] += [3, 4, 5]
    forward(["a", "b"])
    table.release(reqs.pop("c")["row"])
    admit("d", [60, 61, 62], share="a", k=3)  # reuses c's row, over a's first slots
    if drop_one:  # prepared with d's admission write, never run: the engine dropped it
        hb = HostBatch.from_table(
            table,
            np.array([reqs["a"]["row"]]),
            np.array([1]),
            np.array([0]),
            np.array([pool.scratch_slot]),
            np.array([0, 1]),
            np.array([1]),
        )
        model.prepare(hb, pool)
    for _ in range(4):
        forward(["a", "b", "d"])
    return logits, [reqs[n]["tokens"] for n in ("a", "b", "d")]


def _compare(
    tp: tuple[list[torch.Tensor], list[list[int]]], ref: tuple[list[torch.Tensor], list[list[int]]]
) -> dict[str, Any]:
    diffs = [float((x - y).abs().max()) for x, y in zip(tp[0], ref[0], strict=True)]
    return {"max_diff": max(diffs), "forwards": len(diffs), "tokens": tp[1], "ref_tokens": ref[1]}


def engine_scenario(small: CausalLM, large: CausalLM, mode: str) -> dict[str, Any]:
    """A routed generation (tokencache_routing.RoutedEngine) with this large model: random
    escalations (BernoulliRouter), batched catch-ups, prompts on one shared prefix; mode
    "threaded" runs the large model's forwards in a worker thread of their own."""
    from tokencache_routing import BernoulliRouter, EngineConfig, RoutedEngine, SchedulerConfig

    sched = SchedulerConfig(max_running=3, min_large_batch=2, max_wait_steps=2)
    router = BernoulliRouter(0.3, seed=5)
    eng = RoutedEngine(
        small, large, router, config=EngineConfig(num_slots=256, scheduler=sched, mode=mode)
    )
    # The engine builds the large side's table for the workers (runtime.make_slot_table:
    # a TPSlotTable for a tensor-parallel model, whose forwards refuse any other).
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, small.config.vocab_size, (9,), generator=g).tolist()
    prompts = [
        base + torch.randint(0, small.config.vocab_size, (n,), generator=g).tolist()
        for n in (2, 5, 3, 7, 1)
    ]
    res = eng.generate(prompts, 10)
    out = {"tokens": res.tokens, "models": res.models, "idle": eng.idle_invariant()}
    eng.shutdown()
    return out


class PadDecode:
    """configure: padded decode batches on every rank (the CUDA default; CPU here)."""

    def __call__(self, model: CausalLM) -> None:
        model.executor.decode_padding = True


class CrashInForward:
    """configure: a worker rank kills itself inside its n-th forward, after its first
    all-reduce began on the engine's side (the engine then waits in a collective)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __call__(self, model: CausalLM) -> None:
        if model.tp_group is None or model.tp_group.rank == 0:
            return
        calls = [0]
        inner = model.executor.execute

        def execute(step: Any) -> Any:
            calls[0] += 1
            if calls[0] == self.n:
                time.sleep(0.5)  # the engine is inside the forward's collectives by now
                os.kill(os.getpid(), signal.SIGKILL)
            return inner(step)

        model.executor.execute = execute  # type: ignore[method-assign]


def driver_equal(family: str, pad: bool) -> dict[str, Any]:
    model = launch(
        ShardOf(functools.partial(full_model, family)),
        2,
        timeout_s=30,
        configure=PadDecode() if pad else None,
    )
    ref = full_model(family)
    ref.executor.decode_padding = pad
    try:
        out = {"list": _compare(list_scenario(model, model.make_kv_pool(96)),
                                list_scenario(ref, ref.make_kv_pool(96)))}  # fmt: skip
        gc.collect()  # the list run's pool is gone: the workers drop theirs with the next op
        pool, rpool = model.make_kv_pool(128), ref.make_kv_pool(128)
        table = TPSlotTable(2, 4, pool.scratch_slot, pool.device, max_width=pool.num_slots)
        rtable = SlotTable(2, 4, rpool.scratch_slot, rpool.device, max_width=rpool.num_slots)
        out["table"] = _compare(
            table_scenario(model, pool, table, drop_one=True),
            table_scenario(ref, rpool, rtable, drop_one=False),
        )
        out["generations"] = table.generation
        small = random_model(
            dataclasses.replace(CONFIGS[family], num_hidden_layers=1),
            seed=3,
            std=0.3,
            attention_backend="torch",
        )
        small.executor.decode_padding = pad
        mode = "threaded" if family == "llama" else "events"
        out["engine"] = engine_scenario(small, model, mode)
        out["engine_ref"] = engine_scenario(small, ref, mode)
    finally:
        assert model.tp is not None
        model.tp.shutdown()  # type: ignore[attr-defined]
    return out


def driver_kill(mode: str) -> dict[str, Any]:
    configure = CrashInForward(2) if mode == "in-forward" else None
    model = launch(ShardOf(functools.partial(full_model, "qwen3")), 2, timeout_s=30,
                   configure=configure)  # fmt: skip
    driver = model.tp
    procs = driver.procs  # type: ignore[attr-defined]
    pool = model.make_kv_pool(64)
    batch = ForwardBatch.from_requests([[1, 2, 3]], [[]], [[0, 1, 2]])
    model(batch, pool)  # the group works
    if mode.startswith("idle"):
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
    if mode == "idle-unwatched":  # as under torchrun: no process handle, gloo alone tells
        driver.procs = []  # type: ignore[union-attr]
    t0 = time.monotonic()
    err = ""
    try:
        for _ in range(3):  # the failure must come on the first forward after the death
            model(ForwardBatch.from_requests([[4]], [[0, 1, 2]], [[3]]), pool)
    except TPWorkerLost as exc:
        err = str(exc)
    raised_s = time.monotonic() - t0
    again = ""
    try:
        model(ForwardBatch.from_requests([[4]], [[0, 1, 2]], [[3]]), pool)
    except TPWorkerLost as exc:  # and every later one, at once
        again = str(exc)
    t1 = time.monotonic()
    driver.shutdown()  # type: ignore[union-attr]
    return {
        "error": err,
        "again": again,
        "raised_s": raised_s,
        "shutdown_s": time.monotonic() - t1,
        "alive": [p.is_alive() for p in procs],
    }


def run_driver(*args: str, timeout: float = 240) -> dict[str, Any]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


# -- multi-process tests ---------------------------------------------------------------------


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_tp2_equals_tp1(family: str) -> None:
    res = run_driver("equal", family, "pad" if family == "llama" else "nopad")
    for part in ("list", "table"):
        r = res[part]
        assert r["max_diff"] <= TOL, (part, r)
        assert r["tokens"] == r["ref_tokens"], (part, r)
    assert res["table"]["forwards"] == 10
    assert res["generations"] >= 3  # the table grew (rows, width): full copies were sent
    eng, ref = res["engine"], res["engine_ref"]
    assert eng["tokens"] == ref["tokens"] and eng["models"] == ref["models"]
    assert eng["idle"] and ref["idle"]
    escalated = sum(map(sum, eng["models"]))
    assert 0 < escalated < sum(map(len, eng["models"]))  # both models wrote tokens


@pytest.mark.parametrize("mode", ["idle", "idle-unwatched", "in-forward"])
def test_dead_worker_ends_the_driver(mode: str) -> None:
    t0 = time.monotonic()
    res = run_driver("kill", mode, timeout=120)
    assert "tensor-parallel" in res["error"], res
    if mode != "idle-unwatched":  # a launched worker is named with its exit code
        assert "rank 1" in res["error"] and "-9" in res["error"], res
    assert res["raised_s"] < 5.0, res
    assert res["again"], res
    assert res["shutdown_s"] < 5.0 and not any(res["alive"]), res
    assert time.monotonic() - t0 < 120


def test_dead_engine_ends_its_workers() -> None:
    """The engine's process killed outright (no shutdown): its worker exits by itself."""
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, __file__, "orphan"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    pid = json.loads(proc.stdout.strip().splitlines()[-1])["worker_pid"]
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)
    pytest.fail("the worker outlived its engine by 10 s")


def driver_orphan() -> None:
    model = launch(ShardOf(functools.partial(full_model, "qwen3")), 2, timeout_s=30)
    pool = model.make_kv_pool(16)
    model(ForwardBatch.from_requests([[1, 2]], [[]], [[0, 1]]), pool)
    print(json.dumps({"worker_pid": model.tp.procs[0].pid}))  # type: ignore[union-attr]
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


# -- in-process tests ------------------------------------------------------------------------


def test_shapes_must_split() -> None:
    check_divisible(CONFIGS["llama"], 2)
    check_divisible(CONFIGS["llama"], 4)  # 2 KV heads over 4 ranks: each one on two
    with pytest.raises(ValueError, match="num_key_value_heads=2 neither splits"):
        check_divisible(
            dataclasses.replace(CONFIGS["llama"], num_attention_heads=12, intermediate_size=48), 3
        )
    with pytest.raises(ValueError, match="num_attention_heads"):
        check_divisible(CONFIGS["llama"], 16)
    local = shard_config(CONFIGS["llama"], 2)
    assert (local.num_attention_heads, local.num_key_value_heads) == (4, 1)
    assert local.intermediate_size == 32 and local.vocab_size == 100
    local = shard_config(CONFIGS["llama"], 8)  # one query head, a copy of its KV head
    assert (local.num_attention_heads, local.num_key_value_heads) == (1, 1)
    assert [kv_head_of(r, 2, 8) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [kv_head_of(r, 4, 2) for r in range(2)] == [0, 2]
    spans = [vocab_shard(97, r, 2) for r in range(2)]
    assert spans == [(0, 49, 49), (49, 97, 49)]


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_world_one_shard_is_the_model(family: str) -> None:
    """The sharded modules at world 1 compute exactly what the model does."""
    model = full_model(family)
    shard = shard_model(model, TPGroup(0, 1))
    b = ForwardBatch.from_requests([[1, 2, 3, 4], [5, 6]], [[], []], [[0, 1, 2, 3], [4, 5]])
    x = model(b, model.make_kv_pool(16)).logits
    y = shard(b, shard.make_kv_pool(16)).logits
    assert torch.equal(x, y)


class ThreadGroup(TPGroup):
    """One rank of a world whose ranks are threads of this process: all_reduce and the gather
    meet at a barrier (sums in rank order), so a world of 4 or 8 runs without processes."""

    def __init__(self, rank: int, world: int, shared: dict[str, Any]) -> None:
        super().__init__(rank, world)
        self.shared = shared

    def _meet(self, x: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = x.clone()
        barrier.wait()
        got = list(slots)
        barrier.wait()  # everyone has read before the next collective overwrites
        return got

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._meet(x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return x.copy_(total)

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._meet(x))


@pytest.mark.parametrize("family,world", [("llama", 4), ("llama", 8), ("qwen2", 4)])
def test_kv_heads_replicated_when_fewer_than_ranks(family: str, world: int) -> None:
    """2 KV heads over 4 or 8 ranks (threads of this process meeting in their collectives):
    each rank's pool holds one KV head, the copy its query heads read; logits equal the
    unsharded model's over a prefill, an extend beside it and decode steps."""
    import threading

    model = full_model(family)
    shared: dict[str, Any] = {"slots": [None] * world, "barrier": threading.Barrier(world)}
    shards = [shard_model(model, ThreadGroup(r, world, shared)) for r in range(world)]
    assert all(s.shard_config.num_key_value_heads == 1 for s in shards)

    def scenario(m: CausalLM) -> list[torch.Tensor]:
        g = GreedyRunner(m, m.make_kv_pool(64))
        a = g.add_request([3, 14, 15, 92, 65, 35, 8])
        out = [g.step([a]).logits]
        b = g.add_request([3, 14, 15, 92, 7], share_from=a, shared_len=4)
        out.append(g.step([a, b]).logits)
        for _ in range(3):
            out.append(g.step([a, b]).logits)
        return out

    results: list[Any] = [None] * world

    def run(r: int) -> None:
        try:
            results[r] = scenario(shards[r])
        except BaseException as e:  # reported below
            shared["barrier"].abort()
            results[r] = e

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors
    ref = scenario(model)
    for got in results:
        assert max(float((x - y).abs().max()) for x, y in zip(got, ref, strict=True)) <= TOL


def _hb_equal(a: HostBatch, b: HostBatch) -> None:
    for f in ("token_ids", "positions", "out_slots", "q_offsets", "kv_starts", "kv_lens"):
        assert np.array_equal(getattr(a, f), getattr(b, f)), f
    assert a.num_real == b.num_real


def test_metadata_roundtrip_keeps_the_mirror_in_step() -> None:
    """What a worker rebuilds equals the engine's HostBatch; its mirror equals the engine's
    table after every forward: deltas only, the whole table when it grew or a prepared forward
    was dropped; prefix groups travel as the engine found them."""
    table = TPSlotTable(2, 4, 99, "cpu", max_width=64)
    pool = KVPool(1, 99, 1, 4)
    mirrors: dict[int, MirrorTable] = {}
    rng = np.random.default_rng(0)
    lens = {r: 0 for r in (table.acquire(), table.acquire())}
    sizes = []
    for step in range(12):
        if step == 5:
            lens[table.acquire()] = 0  # grows the rows
        rows = np.array(sorted(lens), np.int64)
        q = rng.integers(1, 4, len(rows))
        slots = rng.integers(0, 99, int(q.sum()))
        pos = np.concatenate([lens[int(r)] + np.arange(k) for r, k in zip(rows, q, strict=True)])
        table.scatter(np.repeat(rows, q), pos, slots)
        for r, k in zip(rows.tolist(), q.tolist(), strict=True):
            lens[r] += k
        kv = np.array([lens[int(r)] for r in rows], np.int64)
        hb = HostBatch.from_table(
            table, rows, slots, pos, slots, np.concatenate(([0], np.cumsum(q))), kv
        )
        if step == 3:
            hb.memo["groups"] = [PrefixGroup((0, 1), 2)]
        payload = encode_forward(hb, 0, "torch", step)
        if step == 7:  # dropped: the next forward sends the whole table
            continue
        payload.table.tp_unsent = False  # type: ignore[union-attr]
        sizes.append(len(payload.body))
        got = decode_forward(payload.header, payload.body, mirrors, pool)
        _hb_equal(hb, got)
        assert got.rows is not None and np.array_equal(got.rows, rows)
        assert np.array_equal(mirrors[table.tp_id].host, table.host)
        assert got.memo.get("groups") == ([PrefixGroup((0, 1), 2)] if step == 3 else [])
    assert len(payload.header) == HEADER
    # Deltas are O(batch + new tokens); the first, the grown and the post-drop ones are whole.
    whole = [s for s in sizes if s > 8 * 3 + 64]
    assert 2 <= len(whole) <= 5, sizes


class CountingGroup(TPGroup):
    """A world-2 group that counts its collectives and returns shapes only (meta tensors)."""

    def __init__(self) -> None:
        super().__init__(0, 2)
        self.reduces = self.gathers = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        self.reduces += 1
        return x

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        self.gathers += 1
        return torch.cat([x] * self.world)


@pytest.mark.parametrize("kind", ["prefill", "mixed", "decode-padded"])
def test_shard_forward_never_reads_the_device(kind: str) -> None:
    """A rank's forward on the meta device (any host sync or data-dependent shape raises):
    exactly one all-reduce per attention block and per MLP block, one after the embedding, one
    all-gather of the logits; the logits come back whole (vocabulary order, padding dropped)."""
    from tokencache_models import empty_model

    cfg = CONFIGS["qwen2"]  # biases, and a vocabulary with a padding row
    group = CountingGroup()
    shard = shard_model(empty_model(cfg, device="meta", attention_backend="torch"), group)
    pool = shard.make_kv_pool(64)
    assert pool.k.shape[2] == cfg.num_key_value_heads // 2  # this rank's KV heads only
    if kind == "prefill":
        batch = ForwardBatch.from_requests([[1, 2, 3], [4, 5]], [[], []], [[0, 1, 2], [3, 4]])
    elif kind == "mixed":
        batch = ForwardBatch.from_requests([[1, 2], [3]], [[0, 1], [2, 3]], [[5, 6], [7]])
    else:
        batch = ForwardBatch.from_requests([[1], [3]], [[0, 1], [2, 3]], [[5], [7]])
    shard.executor.decode_padding = kind == "decode-padded"
    out = shard(batch, pool)
    assert out.logits.device.type == "meta"
    assert out.logits.shape == (2, cfg.vocab_size)
    assert (group.reduces, group.gathers) == (2 * cfg.num_hidden_layers + 1, 1)


def test_mirror_queues_device_writes_as_the_engine_does() -> None:
    """Off the CPU (the meta device stands in for CUDA) both tables queue device writes: the
    mirror's queue, applied by the worker's forward, equals the engine's own."""
    table = TPSlotTable(2, 8, 99, "meta", max_width=64)
    pool = KVPool(1, 99, 1, 4, device="meta")
    mirrors: dict[int, MirrorTable] = {}
    r = table.acquire()
    table.write(r, 0, np.array([4, 5, 6]))
    for step in range(3):
        table.scatter(np.array([r]), np.array([3 + step]), np.array([10 + step]))
        hb = HostBatch.from_table(
            table, np.array([r]), np.array([1]), np.array([3 + step]), np.array([10 + step]),
            np.array([0, 1]), np.array([4 + step]),
        )  # fmt: skip
        payload = encode_forward(hb, 0, "torch", step)
        payload.table.tp_unsent = False  # type: ignore[union-attr]
        ours = table.take_writes()
        decode_forward(payload.header, payload.body, mirrors, pool)
        theirs = mirrors[table.tp_id].take_writes()
        if step == 0:  # the first forward loads the whole table: nothing left to apply
            assert theirs is None
            continue
        assert ours is not None and theirs is not None
        assert all(np.array_equal(x, y) for x, y in zip(ours, theirs, strict=True))
        assert np.array_equal(mirrors[table.tp_id].host, table.host)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_checkpoint_shard_reads_the_same_slices(family: str, tmp_path: Path) -> None:
    """load_hf_checkpoint_shard (safetensors slices) builds each rank's shard as shard_model
    does from the whole model (untied qwen2; tied qwen3, saved without lm_head)."""
    from safetensors.torch import save_file

    from tokencache_models.parallel.sharding import load_hf_checkpoint_shard

    model = full_model(family)
    cfg = model.config
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(tmp_path / "model.safetensors"))
    hf = {f: getattr(cfg, f) for f in ("model_type", "vocab_size", "hidden_size",
          "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
          "tie_word_embeddings", "max_position_embeddings")}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({**hf, "dtype": "float32"}))
    for rank in range(2):
        tp = TPGroup(rank, 2)
        a = dict(shard_model(model, tp).named_parameters())
        b = dict(load_hf_checkpoint_shard(str(tmp_path), tp, attention_backend="torch")
                 .named_parameters())  # fmt: skip
        assert a.keys() == b.keys()
        for name in a:
            assert torch.equal(a[name], b[name]), name


if __name__ == "__main__":
    torch.set_num_threads(1)
    kind = sys.argv[1]
    if kind == "orphan":
        driver_orphan()
    if kind == "equal":
        result = driver_equal(sys.argv[2], sys.argv[3] == "pad")
    else:
        result = driver_kill(sys.argv[2])
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)
