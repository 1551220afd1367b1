"""Deferred input tokens (the runner's half of the overlapped scheduler): a forward
whose continuing rows take the previous step's sampled tokens straight from a device tensor
(DeferredTokens) computes exactly what the same forward with those tokens written on the host
computes, on every forward path: eager (unpadded, padded), the graph runner's static path
(prepare + the padded static body; only the capture/replay call needs CUDA), the Triton
kernels and fusions under the interpreter, and the meta device (no host read of the source).

The host token_ids hold placeholders at the deferred positions, chosen to differ from the true
tokens: a path that skipped the resolution would run the placeholders, and each test checks
that those give different logits, so it would fail."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from tokencache_models import (
    QWEN3_0_6B,
    CausalLM,
    DeferredTokens,
    ForwardBatch,
    ForwardOutput,
    HostBatch,
    KVPool,
    SlotTable,
    empty_model,
    random_model,
)
from tokencache_models.executor.decode_graphs import DecodeGraphRunner
from tokencache_models.parallel.tp_layers import TPGroup

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
PROMPT_LENS = (5, 30, 12)


def _model(backend: str = "torch") -> CausalLM:
    return random_model(CFG, seed=0, std=0.2, attention_backend=backend)


def _prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in lengths]


@dataclass
class Step:
    """One forward's requests: row r runs `tokens[r]` (after `prefix[r]`'s slots) into
    `new[r]`; tokens whose (row, j) is in `deferred` come from source[index]."""

    prefix: list[torch.Tensor]
    tokens: list[list[int]]
    new: list[torch.Tensor]
    deferred: dict[tuple[int, int], int]  # (row, token j of the row) -> source index
    in_place: bool = False  # every row's one token is source[row] (DeferredTokens.in_place)


def _host_batch(
    step: Step, source: torch.Tensor, mode: str, layout: str, pool: KVPool
) -> HostBatch:
    """mode: "truth" (true tokens on the host), "deferred" (placeholders + DeferredTokens),
    "placeholders" (placeholders only: what a skipped resolution runs). layout: "list" (a
    ForwardBatch's slot lists) or "table" (slot-table rows, as the engine builds them)."""
    true = source.tolist()
    tokens = [list(t) for t in step.tokens]
    flat, index, dest = 0, [], []
    for r, toks in enumerate(tokens):
        for j in range(len(toks)):
            k = step.deferred.get((r, j))
            if k is not None:
                # Placeholders unlike the truth (and unlike one another).
                toks[j] = true[k] if mode == "truth" else (true[k] + 1 + flat) % CFG.vocab_size
                index.append(k)
                dest.append(flat + j)
        flat += len(toks)
    deferred = (
        DeferredTokens(source, np.array(index), np.array(dest), in_place=step.in_place)
        if mode == "deferred"
        else None
    )
    batch = ForwardBatch.from_requests(tokens, step.prefix, step.new)
    if layout == "list":
        return HostBatch.from_batch(batch, deferred=deferred)
    table = SlotTable(4, 16, pool.scratch_slot, pool.device, max_width=pool.num_slots)
    rows = np.array([table.acquire() for _ in tokens], np.int64)
    for r, (pre, new) in enumerate(zip(step.prefix, step.new, strict=True)):
        table.write(int(rows[r]), 0, torch.cat((pre, new)).numpy())
    return HostBatch.from_table(
        table,
        rows,
        batch.token_ids.numpy(),
        batch.positions.numpy(),
        batch.out_slots.numpy(),
        batch.q_offsets.numpy(),
        batch.kv_lens.numpy(),
        deferred=deferred,
    )


def _scenario(model: CausalLM, kind: str) -> tuple[KVPool, torch.Tensor, Step]:
    """A fresh pool with three prompts prefilled (same slots every call), the prefill's sampled
    tokens as the device source, and the next step: "decode" (rows out of order, two of three
    tokens deferred), "in-place" (every row goes on in its place with its sampled token:
    steady overlapped decoding) or "mixed" (a new prompt, a deferred decode row, a catch-up
    whose first token is deferred)."""
    pool = model.make_kv_pool(256)
    prompts = _prompts(PROMPT_LENS, seed=3)
    slots = [pool.alloc(len(p)) for p in prompts]
    out = model(ForwardBatch.from_requests(prompts, [[]] * 3, slots), pool)
    source = out.logits.argmax(-1)  # the previous step's samples, on the model's device
    first = source.tolist()
    if kind == "in-place":
        new = [pool.alloc(1) for _ in prompts]
        deferred = {(r, 0): r for r in range(len(prompts))}
        step = Step(slots, [[t] for t in first], new, deferred, in_place=True)
    elif kind == "decode":
        order = [2, 0, 1]
        new = [pool.alloc(1) for _ in order]
        # Row 1 (request 0) was known on the host (say, a large model's token).
        step = Step(
            [slots[r] for r in order], [[first[r]] for r in order], new, {(0, 0): 2, (2, 0): 1}
        )
    else:
        fresh = _prompts((6,), seed=4)[0]
        new = [pool.alloc(6), pool.alloc(1), pool.alloc(3)]
        step = Step(
            [torch.empty(0, dtype=torch.int64), slots[1], slots[0]],
            [fresh, [first[1]], [first[0], 7, 9]],
            new,
            {(1, 0): 1, (2, 0): 0},
        )
    return pool, source, step


def _run(model: CausalLM, kind: str, mode: str, layout: str, path: str) -> ForwardOutput:
    pool, source, step = _scenario(model, kind)
    hb = _host_batch(step, source, mode, layout, pool)
    if path == "static":
        runner = DecodeGraphRunner(
            model, pool, model.attention(), model.executor.decode_buckets, 4096
        )
        return runner.run(hb)
    return model.execute(model.prepare(hb, pool))


def _check(model: CausalLM, kind: str, layout: str, path: str) -> None:
    truth = _run(model, kind, "truth", layout, path)
    deferred = _run(model, kind, "deferred", layout, path)
    assert torch.equal(deferred.logits, truth.logits)
    assert torch.equal(deferred.hidden, truth.hidden)
    skipped = _run(model, kind, "placeholders", layout, path)
    assert not torch.equal(skipped.logits, truth.logits)  # a skipped resolution shows


@pytest.mark.parametrize("layout", ["list", "table"])
@pytest.mark.parametrize("kind", ["decode", "decode-padded", "in-place", "mixed"])
def test_eager_forward_with_deferred_tokens_equals_host_tokens(kind: str, layout: str) -> None:
    model = _model()
    model.executor.decode_padding = kind == "decode-padded"  # the CUDA default: padded to a bucket
    _check(model, kind.removesuffix("-padded"), layout, "eager")


@pytest.mark.parametrize("layout", ["list", "table"])
def test_graph_runner_prepare_resolves_deferred_tokens(layout: str) -> None:
    """The graph runner's host preparation and its static body (what a replay runs), on CPU:
    the static token buffer holds the resolved tokens after prepare; the outputs equal the
    host-token run's and the eager padded forward's bit for bit."""
    model = _model()
    _check(model, "decode", layout, "static")
    pool, source, step = _scenario(model, "decode")
    hb = _host_batch(step, source, "deferred", layout, pool)
    runner = DecodeGraphRunner(model, pool, model.attention(), (4,), use_graphs=False)
    static = runner.prepare(hb)
    want = [source.tolist()[r] for r in (2, 0, 1)]
    assert runner._tokens[:3].tolist() == want
    assert hb.token_ids.tolist() != want  # the host copy keeps its placeholders
    out = runner.execute(static)
    model.executor.decode_padding = True
    eager = _run(model, "decode", "truth", layout, "eager")
    assert torch.equal(out.logits, eager.logits)
    # The next step, with host tokens only, runs its own tokens (no stale resolution).
    later = _host_batch(step, source, "placeholders", layout, pool)
    runner.prepare(later)
    assert runner._tokens[:3].tolist() == later.token_ids.tolist() != want


@pytest.mark.parametrize("layout", ["list", "table"])
def test_graph_runner_gathers_a_run_of_deferred_rows_in_one_op(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The overlapped scheduler's usual mixed step: fresh rows first, the rows continuing the
    step before after them, so the deferred tokens' destinations are one run: gathered
    straight into that run of the token buffer (one op, no scatter); a step whose
    destinations have a gap scatters as before."""
    model = _model()
    pool, source, step = _scenario(model, "decode")
    first = source.tolist()
    runner = DecodeGraphRunner(model, pool, model.attention(), (4,), use_graphs=False)
    scatter = torch.Tensor.index_copy_

    def refused(*args: object) -> None:
        raise AssertionError("a run of destinations was scattered")

    monkeypatch.setattr(torch.Tensor, "index_copy_", refused)
    run = Step(step.prefix, step.tokens, step.new, {(1, 0): 0, (2, 0): 1})
    runner.prepare(_host_batch(run, source, "deferred", layout, pool))
    assert runner._tokens[:3].tolist() == [first[2], first[0], first[1]]
    monkeypatch.setattr(torch.Tensor, "index_copy_", scatter)
    gap = Step(step.prefix, step.tokens, step.new, {(0, 0): 1, (2, 0): 0})
    runner.prepare(_host_batch(gap, source, "deferred", layout, pool))
    assert runner._tokens[:3].tolist() == [first[1], first[0], first[0]]


@pytest.mark.parametrize("layout", ["list", "table"])
def test_graph_runner_copies_in_place_deferred_tokens(layout: str) -> None:
    """Steady overlapped decoding (every row goes on in its place): the runner copies the
    source into its token buffer as it is, without the index; the outputs equal the host-token
    run's, and later steps (host tokens; some rows deferred out of place) go by their own."""
    model = _model()
    _check(model, "in-place", layout, "static")
    pool, source, step = _scenario(model, "in-place")
    runner = DecodeGraphRunner(model, pool, model.attention(), (4,), use_graphs=False)
    runner.prepare(_host_batch(step, source, "deferred", layout, pool))
    assert runner._tokens[:3].tolist() == source.tolist()
    runner.prepare(_host_batch(step, source, "placeholders", layout, pool))
    assert runner._tokens[:3].tolist() != source.tolist()  # a host step runs its own tokens
    short = _host_batch(step, source, "deferred", layout, pool)  # of_rows checks nothing:
    short.deferred = DeferredTokens.of_rows(source[:2], np.arange(3), np.arange(3), True)
    with pytest.raises(ValueError, match="in_place"):  # the runner does, before any copy
        runner.prepare(short)
    later, order = Step(step.prefix, step.tokens, step.new, {(0, 0): 2, (2, 0): 1}), [2, 1]
    runner.prepare(_host_batch(later, source, "deferred", layout, pool))
    assert runner._tokens[[0, 2]].tolist() == [source.tolist()[k] for k in order]


@pytest.mark.parametrize("path", ["eager", "padded", "static"])
def test_deferred_tokens_are_resolved_without_reading_the_device(path: str) -> None:
    """On the meta device no tensor has data: a forward whose source tokens live there runs
    only if nothing reads them back on the host."""
    model = empty_model(CFG, device="meta", attention_backend="torch")
    model.executor.decode_padding = path == "padded"
    pool = KVPool.for_config(CFG, 256, device="meta")
    a, b = pool.alloc(9), pool.alloc(4)
    source = torch.empty(5, dtype=torch.int64, device="meta")
    batch = ForwardBatch.from_requests([[0], [0]], [a, b], [pool.alloc(1), pool.alloc(1)])
    hb = HostBatch.from_batch(
        batch, deferred=DeferredTokens(source, np.array([4, 1]), np.array([1, 0]))
    )
    if path == "static":
        runner = DecodeGraphRunner(model, pool, model.attention(), (1, 2, 4), use_graphs=False)
        out = runner.run(hb)
    else:
        out = model.execute(model.prepare(hb, pool))
    assert out.logits.device.type == "meta" and out.logits.shape == (2, CFG.vocab_size)


def test_bad_deferred_tokens_are_refused_early() -> None:
    source = torch.tensor([3, 4, 5])
    batch = ForwardBatch.from_requests([[1], [2]], [[0], [1]], [[2], [3]])
    with pytest.raises(ValueError, match="destinations"):
        DeferredTokens(source, np.array([0, 1]), np.array([0]))  # length mismatch
    with pytest.raises(ValueError, match="out of range"):
        DeferredTokens(source, np.array([3]), np.array([0]))  # past the source
    with pytest.raises(ValueError, match="negative"):
        DeferredTokens(source, np.array([0]), np.array([-1]))
    with pytest.raises(ValueError, match="twice"):
        DeferredTokens(source, np.array([0, 1]), np.array([1, 1]))
    with pytest.raises(ValueError, match="twice"):  # unsorted
        DeferredTokens(source, np.array([0, 1, 2]), np.array([2, 0, 2]))
    with pytest.raises(ValueError, match="int64"):
        DeferredTokens(source.int(), np.array([0]), np.array([0]))
    with pytest.raises(ValueError, match="in_place"):  # in place: index == dest == arange(3)
        DeferredTokens(source, np.array([1, 0, 2]), np.array([0, 1, 2]), in_place=True)
    with pytest.raises(ValueError, match="in_place"):  # not the whole source
        DeferredTokens(source, np.array([0, 1]), np.array([0, 1]), in_place=True)
    DeferredTokens(source, np.arange(3), np.arange(3), in_place=True)
    with pytest.raises(ValueError, match="out of range"):  # the batch has 2 tokens
        HostBatch.from_batch(batch, deferred=DeferredTokens(source, np.array([0]), np.array([2])))
    ok = HostBatch.from_batch(batch, deferred=DeferredTokens(source, np.array([2]), np.array([1])))
    assert ok.padded(4, 99).deferred is ok.deferred  # padding rows come after: kept as is
    # A source on another device than the model: refused before any device work.
    model = _model()
    pool = model.make_kv_pool(16)
    meta = DeferredTokens(
        torch.empty(3, dtype=torch.int64, device="meta"), np.zeros(1), np.zeros(1)
    )
    with pytest.raises(ValueError, match="meta"):
        model.prepare(dataclasses.replace(ok, deferred=meta), pool)


def test_tensor_parallel_model_refuses_deferred_tokens() -> None:
    """Only the small model takes deferred tokens and the large one is the tensor-parallel
    one: the worker ranks would need the resolved tokens (a host sync), so it is refused."""
    model = _model()
    pool = model.make_kv_pool(16)
    batch = ForwardBatch.from_requests([[1]], [[0]], [[1]])
    hb = HostBatch.from_batch(
        batch, deferred=DeferredTokens(torch.tensor([5]), np.array([0]), np.array([0]))
    )
    model.tp_group = TPGroup(0, 2)
    with pytest.raises(ValueError, match="tensor-parallel"):
        model.prepare(hb, pool)
    model.tp_group = None
    model.prepare(hb, pool)


INTERPRET = r"""
# The Triton attention (decode and varlen kernels, the shared-prefix path) and the fusions
# with deferred tokens, under the interpreter; the sync methods of torch.Tensor raise during
# the deferred forward's prepare and execute (the source is never read on the host).
import dataclasses
import numpy as np
import torch
from tokencache_models import QWEN3_0_6B, DeferredTokens, ForwardBatch, HostBatch, random_model

cfg = dataclasses.replace(
    QWEN3_0_6B, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
model = random_model(cfg, seed=0, std=0.2, attention_backend="triton")
model.fused = True


def scenario(kind, mode):
    pool = model.make_kv_pool(512)
    g = torch.Generator().manual_seed(1)
    system = torch.randint(0, 64, (200,), generator=g).tolist()
    prompts = [system + [i] for i in range(4)]
    sys_slots = pool.alloc(200)
    own = [pool.alloc(1) for _ in prompts]
    model(ForwardBatch.from_requests([system], [[]], [sys_slots]), pool)
    out = model(ForwardBatch.from_requests([[p[-1]] for p in prompts], [sys_slots] * 4, own), pool)
    source = out.logits.argmax(-1)
    true = source.tolist()
    prefix = [torch.cat((sys_slots, o)) for o in own]
    if kind == "decode":  # four rows over one system prompt: the shared-prefix kernel
        tokens, pre = [[t] for t in true[::-1]], prefix[::-1]
        index, dest = [3, 2, 1, 0], [0, 1, 2, 3]
        new = [pool.alloc(1) for _ in range(4)]
    else:  # a fresh prefill, a deferred decode row, a catch-up starting with a deferred token
        tokens = [list(range(5)), [true[1]], [true[0], 3, 4]]
        pre, index, dest = [torch.empty(0, dtype=torch.int64), prefix[1], prefix[0]], [1, 0], [5, 6]
        new = [pool.alloc(5), pool.alloc(1), pool.alloc(3)]
    flat = [t for row in tokens for t in row]
    deferred = None
    if mode != "truth":
        for k, d in enumerate(dest):
            flat[d] = (flat[d] + 1 + k) % 64
        if mode == "deferred":
            deferred = DeferredTokens(source, np.array(index), np.array(dest))
    at = 0
    rows = []
    for row in tokens:
        rows.append(flat[at : at + len(row)])
        at += len(row)
    hb = HostBatch.from_batch(ForwardBatch.from_requests(rows, pre, new), deferred=deferred)
    return hb, pool


for kind in ("decode", "mixed"):
    hb, pool = scenario(kind, "truth")
    truth = model.execute(model.prepare(hb, pool))
    hb, pool = scenario(kind, "deferred")
    saved = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "numpy")}

    def refuse(*args, **kwargs):
        raise AssertionError("host sync in a forward with deferred tokens")

    for n in saved:
        setattr(torch.Tensor, n, refuse)
    try:
        step = model.prepare(hb, pool)
        if kind == "decode":
            assert step.context.prefix is not None  # the shared-prefix path ran
        out = model.execute(step)
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
    assert torch.equal(out.logits, truth.logits), kind
    hb, pool = scenario(kind, "placeholders")
    skipped = model.execute(model.prepare(hb, pool))
    assert not torch.equal(skipped.logits, truth.logits), kind
print("OK")
"""


def test_deferred_tokens_on_the_triton_path_in_interpreter() -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "integrations")}
    proc = subprocess.run(
        [sys.executable, "-c", INTERPRET],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
