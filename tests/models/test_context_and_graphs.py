"""The per-forward context, the no-host-sync forward body and the padded static decode path
(the CUDA-graph runner without the capture) against eager, on CPU."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tokencache_models import (
    QWEN3_0_6B,
    CausalLM,
    ForwardBatch,
    KVPool,
    empty_model,
    random_model,
)
from tokencache_models.attention import GROUP_SLACK, GROUP_WASTE, plan_groups
from tokencache_models.executor.decode_graphs import DecodeGraphRunner
from tokencache_models.forward.context import (
    DEFAULT_DECODE_BUCKETS,
    ForwardContext,
    HostBatch,
    decode_bucket,
    decode_kv_width,
)

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


def _model(backend: str = "torch") -> CausalLM:
    return random_model(CFG, seed=0, std=0.2, attention_backend=backend)


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]


def test_context_is_built_on_the_host_with_padding_rows() -> None:
    batch = ForwardBatch.from_requests([[1], [2], [3]], [[0, 1], [2], []], [[5], [6], [7]])
    ctx = ForwardContext.build(batch, torch.device("cpu"), scratch_slot=99, pad_rows_to=4)
    assert ctx.is_decode and ctx.num_requests == 4 and ctx.num_real == 3
    assert ctx.out_slots.tolist() == [5, 6, 7, 99]
    # Rows over the step's slot list; the padding row reads the one scratch entry after it.
    assert ctx.kv_starts.tolist() == [0, 3, 5, 6] and ctx.kv_lens.tolist() == [3, 2, 1, 1]
    assert ctx.kv_slots.tolist() == [0, 1, 5, 2, 6, 7, 99]
    assert ctx.last_token.tolist() == [0, 1, 2, 3]
    assert ctx.kv_width == 64 and ctx.max_q_len == 1
    mixed = ForwardBatch.from_requests([[1, 2], [3]], [[], [0]], [[5, 6], [7]])
    ctx = ForwardContext.build(mixed, torch.device("cpu"), scratch_slot=99)
    assert not ctx.is_decode and ctx.max_q_len == 2 and ctx.last_token.tolist() == [1, 2]
    with pytest.raises(ValueError):
        HostBatch.from_batch(mixed).padded(1, 99)  # fewer rows than requests


def test_bucket_and_width_rules() -> None:
    assert decode_bucket(1, DEFAULT_DECODE_BUCKETS) == 1
    assert decode_bucket(3, DEFAULT_DECODE_BUCKETS) == 4
    assert decode_bucket(33, DEFAULT_DECODE_BUCKETS) == 40
    assert decode_bucket(257, DEFAULT_DECODE_BUCKETS) is None
    assert [decode_kv_width(n) for n in (1, 64, 65, 129, 300)] == [64, 64, 128, 256, 512]


def test_plan_groups_covers_every_request_once_and_splits_skew() -> None:
    q = np.array([1, 1, 120, 1, 5, 6], dtype=np.int64)
    kv = np.array([50, 60, 120, 70, 40, 45], dtype=np.int64)
    groups = plan_groups(q, kv)
    assert sorted(np.concatenate(groups).tolist()) == list(range(6))
    assert len(groups) >= 2 and groups[0][0] == 2  # the long prefill leads its group
    for g in groups:  # no group pads much more than its real work
        padded = len(g) * q[g].max() * kv[g].max()
        assert padded <= GROUP_WASTE * (q[g] * kv[g]).sum() + GROUP_SLACK
    assert 6 * q.max() * kv.max() > GROUP_WASTE * (q * kv).sum() + GROUP_SLACK
    similar = plan_groups(np.full(10, 10), np.full(10, 8192))
    assert len(similar) == 1


def test_pool_scratch_row_is_hidden() -> None:
    pool = KVPool.for_config(CFG, 10)
    assert pool.num_slots == 10 and pool.scratch_slot == 10 and pool.available == 10
    assert pool.k.shape[1] == 10 and pool.k_store.shape[1] == 11
    assert pool.k.data_ptr() == pool.k_store.data_ptr()


def _meta_model() -> tuple[CausalLM, KVPool]:
    model = empty_model(CFG, device="meta", attention_backend="torch")
    return model, KVPool.for_config(CFG, 256, device="meta")


@pytest.mark.parametrize("kind", ["prefill", "mixed", "decode", "decode-padded", "static"])
def test_forward_body_never_reads_the_device(kind: str) -> None:
    """On the meta device a tensor has no data: any .item(), .tolist(), .cpu(), bool(tensor) or
    data-dependent shape (nonzero, boolean indexing, unique) inside the forward raises. The host
    builds the context from the CPU inputs; everything after runs on meta."""
    model, pool = _meta_model()
    a, b, c = pool.alloc(30), pool.alloc(5), pool.alloc(3)
    if kind == "prefill":
        batch = ForwardBatch.from_requests(_prompts([30, 5], 0), [[], []], [a, b])
    elif kind == "mixed":  # a catch-up, a shared-prefix extend and a decode row in one batch
        batch = ForwardBatch.from_requests(
            [[1, 2, 3], [4], [5, 6]], [a[:10], b[:4], a[:20]], [c, b[4:], pool.alloc(2)]
        )
    else:
        batch = ForwardBatch.from_requests(
            [[1], [2], [3]], [a[:-1], b[:-1], c[:-1]], [a[-1:], b[-1:], c[-1:]]
        )
    model.executor.decode_padding = kind != "decode"
    if kind == "static":
        runner = DecodeGraphRunner(model, pool, model.attention(), (1, 2, 4), use_graphs=False)
        out = runner.run(HostBatch.from_batch(batch))
    else:
        out = model(batch, pool)
    assert out.logits.device.type == "meta"
    assert out.logits.shape == (batch.num_requests, CFG.vocab_size)


def test_meta_check_catches_a_host_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    # The check above is only worth something if a sync in the body makes it fail.
    model, pool = _meta_model()
    a = pool.alloc(4)
    batch = ForwardBatch.from_requests([[1, 2, 3, 4]], [[]], [a])
    backend = model.attention()
    prepare = backend.prepare

    def syncing_prepare(ctx: ForwardContext) -> object:
        int(ctx.kv_lens.max())  # what the old backend did per forward
        return prepare(ctx)

    monkeypatch.setattr(backend, "prepare", syncing_prepare)
    with pytest.raises((RuntimeError, NotImplementedError)):
        model(batch, pool)


def _prefill(model: CausalLM, pool: KVPool, prompts: list[list[int]]) -> list[torch.Tensor]:
    slots = [pool.alloc(len(p)) for p in prompts]
    model(ForwardBatch.from_requests(prompts, [[]] * len(prompts), slots), pool)
    return slots


def _decode_batch(
    pool: KVPool, slots: list[torch.Tensor], tokens: list[int]
) -> tuple[ForwardBatch, list[torch.Tensor]]:
    new = [pool.alloc(1) for _ in tokens]
    batch = ForwardBatch.from_requests([[t] for t in tokens], slots, new)
    return batch, [torch.cat((s, n)) for s, n in zip(slots, new, strict=True)]


@pytest.mark.parametrize("n_requests", [1, 3, 17])
def test_static_padded_decode_equals_eager_bit_for_bit(n_requests: int) -> None:
    """Eager decode (padded to the bucket, as on CUDA) and the graph runner's static path (static
    buffers, padding rows on the scratch slot) agree exactly in fp32, steps after step, and
    leave identical pools; the only piece not run here is torch.cuda.graph capture/replay."""
    model = _model()
    model.executor.decode_padding = True
    prompts = _prompts([(23 * i) % 120 + 1 for i in range(n_requests)], seed=n_requests)
    pool_e, pool_s = model.make_kv_pool(2048), model.make_kv_pool(2048)
    slots_e, slots_s = _prefill(model, pool_e, prompts), _prefill(model, pool_s, prompts)
    runner = DecodeGraphRunner(
        model, pool_s, model.attention(), model.executor.decode_buckets, 4096, False
    )
    tokens = [p[-1] for p in prompts]
    for _ in range(24):  # contexts cross the 64- and 128-wide gather widths
        be, slots_e = _decode_batch(pool_e, slots_e, tokens)
        bs, slots_s = _decode_batch(pool_s, slots_s, tokens)
        assert torch.equal(be.kv_slots, bs.kv_slots)
        eager = model(be, pool_e)
        static = runner.run(HostBatch.from_batch(bs))
        assert torch.equal(eager.logits, static.logits)
        assert torch.equal(eager.hidden, static.hidden)
        tokens = eager.logits.argmax(-1).tolist()
    assert torch.equal(pool_e.k, pool_s.k) and torch.equal(pool_e.v, pool_s.v)


def test_static_decode_close_to_unpadded_eager() -> None:
    # CPU default: eager decode is not padded; fp32 GEMMs of 3 and of 4 rows may round
    # differently, so only closeness and the greedy tokens are exact here.
    model = _model()
    assert not model.executor.pads_decode()
    prompts = _prompts([5, 40, 77], seed=9)
    pool_e, pool_s = model.make_kv_pool(512), model.make_kv_pool(512)
    slots_e, slots_s = _prefill(model, pool_e, prompts), _prefill(model, pool_s, prompts)
    runner = DecodeGraphRunner(model, pool_s, model.attention(), (4,), use_graphs=False)
    tokens = [p[-1] for p in prompts]
    for _ in range(10):
        be, slots_e = _decode_batch(pool_e, slots_e, tokens)
        bs, slots_s = _decode_batch(pool_s, slots_s, tokens)
        eager, static = model(be, pool_e), runner.run(HostBatch.from_batch(bs))
        torch.testing.assert_close(static.logits, eager.logits, atol=1e-5, rtol=0)
        assert eager.logits.argmax(-1).tolist() == static.logits.argmax(-1).tolist()
        tokens = eager.logits.argmax(-1).tolist()


def test_graph_runner_fallbacks_and_switches() -> None:
    model = _model()
    pool = model.make_kv_pool(300)
    runner = DecodeGraphRunner(model, pool, model.attention(), (1, 2, 4), 16, use_graphs=False)
    a = pool.alloc(6)
    multi = HostBatch.from_batch(ForwardBatch.from_requests([[1, 2]], [a[:4]], [a[4:]]))
    assert not runner.fits(multi)  # multi-token rows run eagerly
    five = ForwardBatch.from_requests([[1]] * 5, [[]] * 5, [[i] for i in range(5)])
    assert not runner.fits(HostBatch.from_batch(five))  # beyond the largest bucket
    long = ForwardBatch.from_requests([[1]], [pool.alloc(20)], [pool.alloc(1)])
    assert not runner.fits(HostBatch.from_batch(long))  # slot list over kv_capacity
    with pytest.raises(ValueError):
        runner.run(HostBatch.from_batch(long))
    # Off CUDA, capture_all runs each key's static path once (the warm-up without capture):
    # the keys are warm from then on, and a step outside them counts as a cold run.
    assert runner.capture_all(max_rows=2) == 0 and runner.captures == 0
    assert {k[0] for k in runner.warm_keys} == {1, 2} and runner.cold_runs == 0
    four = ForwardBatch.from_requests([[1]] * 3, [a[:2]] * 3, [pool.alloc(1) for _ in range(3)])
    runner.run(HostBatch.from_batch(four))  # the 4-row bucket: not warmed
    assert runner.cold_runs == 1
    with pytest.raises(ValueError):
        DecodeGraphRunner(model, pool, model.attention(), (2,), use_graphs=True)  # CPU model
    with pytest.raises(ValueError):
        DecodeGraphRunner(model, pool, model.attention(), ())
    # Made inside inference mode (as model.forward does), run outside it.
    with torch.inference_mode():
        inner = DecodeGraphRunner(model, pool, model.attention(), (1, 2), use_graphs=False)
    one = ForwardBatch.from_requests([[1]], [a[:3]], [pool.alloc(1)])
    torch.testing.assert_close(inner.run(HostBatch.from_batch(one)).logits, model(one, pool).logits)
    # The runner only weakly refers to its pool: dropping the pool frees it (and its graphs).
    tmp = model.make_kv_pool(8)
    tmp_runner = DecodeGraphRunner(model, tmp, model.attention(), (1,), use_graphs=False)
    del tmp
    with pytest.raises(RuntimeError):
        _ = tmp_runner.pool
    # On CPU the executor never makes a graph runner, whatever the switch says.
    executor = model.executor
    assert executor.decode_graphs and executor.graph_runner(pool, model.attention()) is None
    assert executor.prepare_runner(pool) is None
    pool8 = model.make_kv_pool(8)
    executor.decode_padding = True
    assert executor.prepare_runner(pool8) is None
    model(five, pool8)
    assert not executor.runners(pool8)


def test_backend_is_built_once_per_model() -> None:
    model = _model()
    assert model.attention() is model.attention("torch")
    assert model.attention("triton") is model.attention("triton")
    assert model.attention("triton") is not model.attention("torch")


def test_the_executor_owns_the_forward_switches_and_the_context_is_frozen() -> None:
    model = _model()
    executor = model.executor
    assert executor.model is model and not executor.pads_decode()
    with pytest.raises(AttributeError, match="executor"):
        model.decode_padding = True  # would silently do nothing: refused with a pointer
    a = ForwardBatch.from_requests([[1, 2, 3]], [[]], [[0, 1, 2]])
    ctx = executor.build_context(a, model.make_kv_pool(8), model.attention())
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.num_real = 0  # type: ignore[misc]
    pool = model.make_kv_pool(8)
    torch.testing.assert_close(model(a, pool).logits, executor.forward(a, pool).logits)


def test_the_network_is_below_its_executor_and_graph_runners() -> None:
    """model -> executor -> graph runners -> forward context, one way, annotations included: the
    runners see the network through decode_graphs.ForwardBody, never by importing the model."""
    import ast
    from pathlib import Path

    import tokencache_models

    root = Path(tokencache_models.__file__).parent
    executor = "tokencache_models.executor.model_executor"
    for name in (
        "executor.model_executor",
        "executor.decode_graphs",
        "executor.extend_graphs",
        "forward.context",
        "attention",
    ):
        package = ["tokencache_models", *name.split(".")[:-1]]
        tree = ast.parse((root / f"{name.replace('.', '/')}.py").read_text())
        imported = {
            ".".join([*package[: len(package) - node.level + 1], *filter(None, [node.module])])
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.level
        }
        assert "tokencache_models.forward.context" in imported or name == "forward.context"
        assert "tokencache_models.model" not in imported, name
        if f"tokencache_models.{name}" != executor:
            assert executor not in imported, name


def test_a_model_pickles_with_its_executor_switches_and_without_its_runners() -> None:
    """A tensor-parallel worker receives its model through a spawn (pickle): the executor's
    switches travel with it, its graph runners (this process's pools) do not."""
    import pickle

    from tokencache_models import random_model

    model = random_model(CFG, seed=3)
    model.executor.decode_padding = True
    model.executor.decode_buckets = (1, 2, 4)
    copy = pickle.loads(pickle.dumps(model))
    assert copy.executor.decode_padding is True and copy.executor.decode_buckets == (1, 2, 4)
    assert copy.executor.model is copy and copy.executor.runners(model.make_kv_pool(8)) == []


def test_prefix_tables_kept_between_steps_equal_fresh_ones() -> None:
    """The graph runner keeps the last step's shared-prefix tables while candidate groups, rows
    and offsets repeat: step after step, as rows join and leave, a row's request is replaced
    by one on the other prompt (same place, new groups) and contexts grow, it loads exactly
    what a runner building every step from scratch loads. Rows keep fixed places in a flat
    slot buffer, as in the engine's slot table, so most steps repeat their offsets."""
    model = _model("triton")
    pool = model.make_kv_pool(16384)
    backend = model.attention("triton")
    assert backend.shares_prefix
    kept = DecodeGraphRunner(model, pool, backend, (2, 4, 8), use_graphs=False)
    width = 1024
    flat = np.zeros(8 * width, np.int64)
    lens = [0] * 8
    prompts = [pool.alloc(600).numpy(), pool.alloc(700).numpy()]

    def start(i: int, prompt: int) -> None:  # a new request on prompt in row i's place
        own = pool.alloc(3 + i).numpy()
        flat[i * width : i * width + len(prompts[prompt]) + len(own)] = np.concatenate(
            (prompts[prompt], own)
        )
        lens[i] = len(prompts[prompt]) + len(own)

    for i in range(8):
        start(i, i % 2)
    rng = np.random.default_rng(5)
    hits = loads = 0
    for step in range(32):
        live = list(range(8))
        if step % 4 == 1:  # some rows wait this step
            live = sorted(rng.choice(8, size=int(rng.integers(2, 8)), replace=False).tolist())
        if step % 8 in (5, 6):  # the same groups twice, from other places (anchors move)
            family = [[i for i in range(8) if flat[i * width] == p[0]] for p in prompts]
            first = family[0] if step % 8 == 5 else family[0][1:] + family[0][:1]
            live = first + family[1]
        if step % 8 == 3:  # a request ends, another takes its place on the other prompt
            i = int(rng.integers(8))
            start(i, int(flat[i * width] == prompts[0][0]))
        new = pool.alloc(len(live)).numpy()
        for i, slot in zip(live, new.tolist(), strict=True):
            flat[i * width + lens[i]] = slot
            lens[i] += 1
        n = len(live)
        hb = HostBatch(
            token_ids=np.ones(n, np.int64),
            positions=np.array([lens[i] - 1 for i in live], np.int64),
            out_slots=new,
            q_offsets=np.arange(n + 1, dtype=np.int64),
            kv_slots=flat,
            kv_starts=np.array([i * width for i in live], np.int64),
            kv_lens=np.array([lens[i] for i in live], np.int64),
            num_real=n,
        )
        before = kept._tables
        fresh = DecodeGraphRunner(model, pool, backend, (2, 4, 8), use_graphs=False)
        a = kept.prepare(hb)
        b = fresh.prepare(dataclasses.replace(hb, memo={}))
        assert a.key == b.key
        hits += kept._tables is before and before is not None
        loads += a.key[2] > 0  # steps that read a shared prefix
        # What the step's forward reads: every buffer view of its static context.
        ca, cb = kept.static_context(*a.key[:4]), fresh.static_context(*b.key[:4])
        for name in ("token_ids", "positions", "out_slots", "kv_starts", "kv_lens"):
            assert torch.equal(getattr(ca, name), getattr(cb, name)), name
        assert (ca.prefix is None) == (cb.prefix is None)
        if ca.prefix is not None and cb.prefix is not None:
            assert torch.equal(ca.prefix.row_skip, cb.prefix.row_skip)
            assert torch.equal(ca.prefix.tiles, cb.prefix.tiles)
            assert torch.equal(ca.prefix.tokens, cb.prefix.tokens)
    assert loads >= 24 and hits >= 6  # the kept tables served many steps
