"""Multi-token forwards through the CUDA-graph runner's static path (extend_graphs.py: the
layout a graph replays, without the capture) against eager, on CPU: catch-ups over cached
context, prefill chunks, shared prefixes, every bucket edge; padding writes only the scratch
slot; shapes outside the buckets run eagerly; the executor counts forwards by path."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokencache_models import QWEN3_0_6B, CausalLM, ForwardBatch, KVPool, random_model
from tokencache_models.executor.extend_graphs import DEFAULT_EXTEND_TOKENS, ExtendGraphRunner
from tokencache_models.forward.context import HostBatch
from tokencache_models.forward.epilogue import Epilogue
from tokencache_models.kv.slot_table import SlotTable

CFG = dataclasses.replace(
    QWEN3_0_6B,
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
)


@pytest.fixture(scope="module")
def model() -> CausalLM:
    return random_model(CFG, seed=0, std=0.2, attention_backend="torch")


def _tokens(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist()


def _twin_pools(model: CausalLM, contexts: list[int], seed: int) -> tuple[list[KVPool], list]:
    """Two pools holding the same prefilled contexts (same slots): eager's and the runner's."""
    prompts = [_tokens(n, seed + i) for i, n in enumerate(contexts)]
    pools, slots = [], []
    for _ in range(2):
        pool = model.make_kv_pool(4096)
        s = [pool.alloc(n) for n in contexts]
        for p, sl in zip(prompts, s, strict=True):  # one request a forward: plain prefills
            if p:
                model(ForwardBatch.from_requests([p], [[]], [sl]), pool)
        pools.append(pool)
        slots.append(s)
    assert all(torch.equal(a, b) for a, b in zip(*slots, strict=True))
    return pools, slots[0]


def _catchup(pool: KVPool, prefix: list[torch.Tensor], new: list[int], seed: int) -> ForwardBatch:
    tokens = [_tokens(n, 1000 + seed + i) for i, n in enumerate(new)]
    return ForwardBatch.from_requests(tokens, prefix, [pool.alloc(n) for n in new])


def _compare(eager: object, static: object) -> None:
    e, s = eager.logits, static.logits  # type: ignore[attr-defined]
    assert e.shape == s.shape
    torch.testing.assert_close(s, e, atol=1e-4, rtol=0)
    torch.testing.assert_close(static.hidden, eager.hidden, atol=1e-4, rtol=0)  # type: ignore[attr-defined]
    assert e.argmax(-1).tolist() == s.argmax(-1).tolist()


@pytest.mark.parametrize(
    "contexts,new",
    [
        ([40], [10]),  # one request catching up 10 tokens
        ([40, 90, 7, 64], [10, 3, 1, 16]),  # ragged catch-ups; a one-token row among them
        ([33] * 10, [10] * 10),  # 10 x 10: 100 tokens in the 128 bucket
        ([0], [37]),  # a prefill chunk
        ([0, 50], [16, 16]),  # tokens exactly a bucket: no padding row
        ([20, 20, 20], [9, 9, 9]),  # a q_width of 16 for 9-token rows
        ([12] * 7, [1, 2, 3, 4, 5, 6, 70]),  # one long row: q_width 128
    ],
)
def test_static_extend_equals_eager(model: CausalLM, contexts: list[int], new: list[int]) -> None:
    (pool_e, pool_s), slots = _twin_pools(model, contexts, seed=len(new))
    runner = ExtendGraphRunner(model, pool_s, model.attention(), use_graphs=False)
    be = _catchup(pool_e, slots, new, seed=3)
    bs = _catchup(pool_s, slots, new, seed=3)
    assert torch.equal(be.out_slots, bs.out_slots)
    hb = HostBatch.from_batch(bs)
    assert runner.fits(hb)
    rows, tokens, q_width = runner.shape(hb)  # type: ignore[misc]
    assert tokens >= sum(new) and q_width >= max(new) and rows > len(new) - (tokens == sum(new))
    _compare(model(be, pool_e), runner.run(hb))
    # The real rows wrote the same K/V; nothing else changed but the scratch slot.
    torch.testing.assert_close(pool_s.k, pool_e.k, atol=1e-5, rtol=0)
    torch.testing.assert_close(pool_s.v, pool_e.v, atol=1e-5, rtol=0)


def test_shared_prefix_rows_and_a_decode_row_in_one_catch_up(model: CausalLM) -> None:
    """Rows behind one prompt (their slot lists share its slots) beside a one-token row."""
    (pool_e, pool_s), (system,) = _twin_pools(model, [120], seed=5)
    runner = ExtendGraphRunner(model, pool_s, model.attention(), use_graphs=False)
    outs = []
    for pool in (pool_e, pool_s):
        tails = [pool.alloc(n) for n in (3, 5, 1)]
        batch = ForwardBatch.from_requests(
            [_tokens(n, 70 + n) for n in (3, 5, 1)], [system, system, system], tails
        )
        outs.append(
            model(batch, pool) if pool is pool_e else runner.run(HostBatch.from_batch(batch))
        )
    _compare(*outs)


def test_the_epilogue_runs_in_the_static_path(model: CausalLM) -> None:
    (pool_e, pool_s), slots = _twin_pools(model, [30, 31], seed=8)
    runner = ExtendGraphRunner(model, pool_s, model.attention(), use_graphs=False)
    epi = Epilogue(CFG.vocab_size, entropy=True, escalate_at=2.0)
    e = epi.apply(model(_catchup(pool_e, slots, [4, 6], seed=1), pool_e))
    s = runner.run(HostBatch.from_batch(_catchup(pool_s, slots, [4, 6], seed=1)), epi)
    assert s.greedy is not None and s.entropy is not None and s.escalate is not None
    assert s.greedy.tolist() == e.greedy.tolist()  # type: ignore[union-attr]
    torch.testing.assert_close(s.entropy, e.entropy, atol=1e-4, rtol=0)
    assert s.escalate.tolist() == e.escalate.tolist()  # type: ignore[union-attr]


def test_over_a_slot_table_with_queued_writes(model: CausalLM) -> None:
    """Rows of a slot table (what the engine runs), steps after step, widths growing."""
    pools, _ = _twin_pools(model, [], seed=0)
    pool_e, pool_s = pools
    tables = [SlotTable(8, 16, pool.scratch_slot, torch.device("cpu"), 4096) for pool in pools]
    rows = np.array([t.acquire() for t in tables[1:] for _ in range(3)], np.int64)
    for t in tables[:1]:
        for _ in range(3):
            t.acquire()
    runner = ExtendGraphRunner(model, pool_s, model.attention(), use_graphs=False)
    lens = np.zeros(3, np.int64)
    for step, new in enumerate(([20, 5, 9], [3, 1, 12], [8, 8, 8], [40, 2, 2])):
        q = np.asarray(new, np.int64)
        tokens = np.concatenate([_tokens(n, 50 * step + i) for i, n in enumerate(new)])
        positions = np.concatenate([np.arange(a, a + n) for a, n in zip(lens, q, strict=True)])
        outs = []
        for pool, table in zip(pools, tables, strict=True):
            out = pool.alloc(int(q.sum())).numpy()
            table.scatter(np.repeat(rows, q), positions, out)
            hb = HostBatch.from_table(
                table, rows, tokens, positions, out, np.concatenate(([0], np.cumsum(q))), lens + q
            )
            if pool is pool_s:
                assert runner.fits(hb)
                outs.append(runner.run(hb))
            else:
                outs.append(model(hb, pool))
        _compare(*outs)
        lens += q
    torch.testing.assert_close(pool_s.k, pool_e.k, atol=1e-5, rtol=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 60), st.integers(1, 40)), min_size=1, max_size=12
    ).filter(lambda r: sum(n for _, n in r) <= 256 and max(n for _, n in r) > 1),
    seed=st.integers(0, 2**16),
)
def test_padding_never_writes_a_live_slot(
    model: CausalLM, rows: list[tuple[int, int]], seed: int
) -> None:
    """Whatever the layout pads (tokens to the bucket, rows to theirs), every slot but the
    step's own out slots and the scratch slot keeps its K/V bit for bit."""
    contexts, new = [c for c, _ in rows], [n for _, n in rows]
    pool = model.make_kv_pool(2048)
    g = torch.Generator().manual_seed(seed)
    pool.k_store.normal_(generator=g)  # every slot holds something a stray write would change
    pool.v_store.normal_(generator=g)
    perm = torch.randperm(pool.num_slots, generator=g)
    prefix, o = [], 0
    for c in contexts:
        prefix.append(perm[o : o + c])
        o += c
    out_slots = [perm[o + sum(new[:i]) : o + sum(new[: i + 1])] for i in range(len(new))]
    batch = ForwardBatch.from_requests([_tokens(n, seed + n) for n in new], prefix, out_slots)
    k0, v0 = pool.k_store.clone(), pool.v_store.clone()
    runner = ExtendGraphRunner(model, pool, model.attention(), use_graphs=False)
    hb = HostBatch.from_batch(batch)
    assert runner.fits(hb)
    runner.run(hb)
    keep = torch.ones(pool.num_slots + 1, dtype=torch.bool)
    keep[torch.cat(out_slots)] = False
    keep[pool.scratch_slot] = False
    assert torch.equal(pool.k_store[:, keep], k0[:, keep])
    assert torch.equal(pool.v_store[:, keep], v0[:, keep])
    # The live slots the step wrote hold what eager writes there.
    ref = model.make_kv_pool(2048)
    ref.k_store.copy_(k0), ref.v_store.copy_(v0)
    model(batch, ref)
    live = torch.cat(out_slots)
    torch.testing.assert_close(pool.k_store[:, live], ref.k_store[:, live], atol=1e-5, rtol=0)
    torch.testing.assert_close(pool.v_store[:, live], ref.v_store[:, live], atol=1e-5, rtol=0)


def test_buckets_and_fallbacks(model: CausalLM) -> None:
    pool = model.make_kv_pool(2048)
    runner = ExtendGraphRunner(model, pool, model.attention(), rows=(1, 2, 4), tokens=(16, 32))
    assert not runner.use_graphs  # a CPU model
    a = pool.alloc(40)

    def hb(new: list[int], prefix: int = 4) -> HostBatch:
        return HostBatch.from_batch(
            ForwardBatch.from_requests(
                [[1] * n for n in new], [a[:prefix]] * len(new), [pool.alloc(n) for n in new]
            )
        )

    assert runner.shape(hb([3, 5])) == (4, 16, 16)  # 8 tokens + a padding row of 8
    assert runner.shape(hb([8, 8])) == (2, 16, 16)  # exactly the bucket: no padding row
    assert runner.shape(hb([10, 10])) == (4, 32, 16)  # 12 padding tokens: one row of 12
    assert runner.shape(hb([17, 2])) == (4, 32, 64)  # a row of 17 tokens: q_width 64
    assert not runner.fits(hb([20, 20]))  # 40 tokens: over the largest token bucket
    assert not runner.fits(hb([1, 1, 1, 1]))  # 4 rows + a padding row: over the row buckets
    assert not runner.fits(hb([1, 1, 1, 1, 1]))
    assert not runner.fits(hb([1], 8))  # a decode step: the decode runner's
    with pytest.raises(ValueError, match="does not fit"):
        runner.prepare(hb([20, 20]))
    small = ExtendGraphRunner(model, pool, model.attention(), kv_capacity=16, use_graphs=False)
    assert not small.fits(hb([2], prefix=20))  # a slot list over the runner's buffer
    with pytest.raises(ValueError):
        ExtendGraphRunner(model, pool, model.attention(), tokens=())
    with pytest.raises(ValueError):
        ExtendGraphRunner(model, pool, model.attention(), use_graphs=True)  # a CPU model
    assert DEFAULT_EXTEND_TOKENS[-1] == 2048  # the default chunked-prefill budget


def test_the_executor_routes_and_counts_forwards_by_path() -> None:
    model = random_model(CFG, seed=0, std=0.2, attention_backend="torch")
    executor = model.executor
    pool = model.make_kv_pool(4096)
    a, b = pool.alloc(20), pool.alloc(5)
    prefill = ForwardBatch.from_requests([_tokens(20, 1)], [[]], [a])
    # Off CUDA: eager unless the static path is asked for; no runner made.
    model(prefill, pool)
    assert executor.extend_graph_runner(pool, model.attention()) is None
    assert executor.forwards == {"extend eager": 1}
    executor.extend_runner = True
    catchup = ForwardBatch.from_requests([_tokens(5, 2)], [a], [b])
    out = model(catchup, pool)
    (runner,) = executor.extend_runners(pool)
    assert executor.forwards["extend static"] == 1
    big = ForwardBatch.from_requests([_tokens(2100, 3)], [[]], [pool.alloc(2100)])
    model(big, pool)  # over the largest token bucket: eager
    assert executor.forwards["extend eager"] == 2
    step = model.prepare(catchup, pool)
    assert executor.path_of(step) == "extend static" and step.extend_runner is runner
    executor.extend_graphs = False
    assert executor.path_of(model.prepare(catchup, pool)) == "extend eager"
    assert executor.extend_graph_runner(pool, model.attention()) is None
    # The switches travel with a pickled model, the runners do not.
    clone = pickle.loads(pickle.dumps(model))
    assert clone.executor.extend_runner is True and not clone.executor.extend_runners(pool)
    assert out.logits.shape == (1, CFG.vocab_size)


TRITON_STATIC_EXTEND = r"""
import dataclasses
import torch
from tokencache_models import QWEN3_0_6B, ForwardBatch, random_model
from tokencache_models.forward.context import HostBatch
from tokencache_models.executor.extend_graphs import ExtendGraphRunner

cfg = dataclasses.replace(
    QWEN3_0_6B, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
torch.manual_seed(0)
model = random_model(cfg, seed=0, std=0.2, attention_backend="triton")
model.fused = True  # the Triton fusions too, as on CUDA
pools = [model.make_kv_pool(1024) for _ in range(2)]
contexts, new = [300, 17, 120], [10, 3, 7]
prompts = [torch.randint(0, 64, (n,)).tolist() for n in contexts]
tails = [torch.randint(0, 64, (n,)).tolist() for n in new]
runner = ExtendGraphRunner(model, pools[1], model.attention(), use_graphs=False)
outs = []
for pool in pools:
    slots = [pool.alloc(n) for n in contexts]
    for p, s in zip(prompts, slots):
        model(ForwardBatch.from_requests([p], [[]], [s]), pool)
    batch = ForwardBatch.from_requests(tails, slots, [pool.alloc(n) for n in new])
    if pool is pools[0]:
        outs.append(model(batch, pool))
    else:
        hb = HostBatch.from_batch(batch)
        step = runner.prepare(hb)
        assert step.key[4] >= 1, step.key  # a split count fixed by the key
        outs.append(runner.execute(step))
e, s = outs
err = (e.logits - s.logits).abs().max().item()
assert err < 1e-4, err
assert e.logits.argmax(-1).tolist() == s.logits.argmax(-1).tolist()
print("OK")
"""


def test_triton_static_extend_equals_eager_in_interpreter() -> None:
    """The Triton varlen kernel over the static layout (grid from the key, splits fixed)
    computes what the eager launch does, under TRITON_INTERPRET=1 (a subprocess: the variable
    must be set before triton is imported)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "integrations")}
    proc = subprocess.run(
        [sys.executable, "-c", TRITON_STATIC_EXTEND],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


@settings(max_examples=200, deadline=None)
@given(q_lens=st.lists(st.integers(1, 520), min_size=1, max_size=70), cap=st.integers(1, 70))
def test_every_step_shape_is_a_key_captured_up_front(q_lens: list[int], cap: int) -> None:
    """shapes() holds the shape of every step that fits (what capture_all captures, so a
    warmed-up runner never captures while serving), and only keys within the caps."""
    model = random_model(CFG, seed=0, std=0.2, attention_backend="torch")
    runner = ExtendGraphRunner(model, model.make_kv_pool(8), model.attention(), use_graphs=False)
    total = sum(q_lens)
    hb = HostBatch(
        token_ids=np.zeros(total, np.int64),
        positions=np.zeros(total, np.int64),
        out_slots=np.zeros(total, np.int64),
        q_offsets=np.concatenate(([0], np.cumsum(q_lens))),
        kv_slots=np.zeros(1, np.int64),
        kv_starts=np.zeros(len(q_lens), np.int64),
        kv_lens=np.asarray(q_lens, np.int64),
        num_real=len(q_lens),
    )
    shape = runner.shape(hb)
    if shape is None:
        return
    assert shape in runner.shapes()
    if len(q_lens) <= cap:
        assert shape in runner.shapes(max_rows=cap, max_tokens=total)
    assert all(k[1] <= max(16, 2 * total) for k in runner.shapes(cap, total))
