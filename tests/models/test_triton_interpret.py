"""The Triton kernels, run by Triton's CPU interpreter, against the torch path.

TRITON_INTERPRET must be set before triton is imported, hence a subprocess per script. Shapes are
small (few heads, small head dims) so the interpreter stays fast; contexts go up to 8k.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

COMMON = r"""
import numpy as np
import torch
from tokencache_models.attention import TorchPagedAttention
from tokencache_models.forward.forward_batch import ForwardBatch
from tokencache_models.forward.context import ForwardContext

torch.manual_seed(0)


def torch_reference(batch, q, kc, vc, scale):
    # kc / vc carry the scratch row last, as KVPool.k_store does.
    backend = TorchPagedAttention()
    ctx = ForwardContext.build(batch, torch.device("cpu"), kc.shape[0] - 1, backend.plan)
    return backend.forward(q, kc, vc, ctx, backend.prepare(ctx), scale), ctx


def scattered_requests(perm, prefix_lens, q_lens, shared=None):
    # Request i: prefix of prefix_lens[i] slots (or `shared`'s first slots) + q_lens[i] new ones,
    # all taken from a random permutation of the pool (page-scattered).
    pre, new, o = [], [], 0
    for p, n in zip(prefix_lens, q_lens):
        if shared is not None:
            s = shared[:p]
        else:
            s = perm[o : o + p]
            o += p
        pre.append(s)
        new.append(perm[o : o + n])
        o += n
    return pre, new
"""

DECODE = r"""
from tokencache_models.kernels.decode_attention import paged_decode

for heads, kv_heads, head_dim in [(8, 2, 32), (6, 3, 24)]:
    slots_total = 700
    kc = torch.randn(slots_total + 1, kv_heads, head_dim)
    vc = torch.randn(slots_total + 1, kv_heads, head_dim)
    lens = [1, 7, 64, 65, 300]
    pre, new = scattered_requests(torch.randperm(slots_total), [n - 1 for n in lens], [1] * 5)
    batch = ForwardBatch.from_requests([[0]] * len(lens), pre, new)
    q = torch.randn(len(lens), heads, head_dim)
    ref, ctx = torch_reference(batch, q, kc, vc, head_dim**-0.5)
    assert ctx.is_decode
    for block_n in (16, 64):
        out = paged_decode(
            q, kc, vc, batch.kv_slots, batch.kv_starts, batch.kv_lens, head_dim**-0.5,
            block_n=block_n,
        )
        err = (out - ref).abs().max().item()
        assert err < 1e-4, (heads, kv_heads, head_dim, block_n, err)
print("OK")
"""

VARLEN = r"""
from tokencache_models.kernels.varlen_attention import paged_varlen

def check(heads, kv_heads, head_dim, prefix_lens, q_lens, shared_prefix=0, rows=16, block_n=16):
    total = sum(prefix_lens) + sum(q_lens) + shared_prefix + 8
    kc = torch.randn(total + 1, kv_heads, head_dim)
    vc = torch.randn(total + 1, kv_heads, head_dim)
    perm = torch.randperm(total)
    shared = None
    if shared_prefix:
        shared = perm[-shared_prefix:]
        perm = perm[:-shared_prefix]
        prefix_lens = [shared_prefix] * len(q_lens)
    pre, new = scattered_requests(perm, prefix_lens, q_lens, shared)
    toks = [[0] * n for n in q_lens]
    batch = ForwardBatch.from_requests(toks, pre, new)
    q = torch.randn(batch.num_tokens, heads, head_dim)
    ref, ctx = torch_reference(batch, q, kc, vc, head_dim**-0.5)
    out = paged_varlen(
        q, kc, vc, batch.kv_slots, batch.q_offsets, batch.kv_starts, batch.kv_lens,
        head_dim**-0.5,
        ctx.max_q_len, rows=rows, block_n=block_n,
    )
    err = (out - ref).abs().max().item()
    assert err < 1e-4, (heads, kv_heads, head_dim, prefix_lens[:4], q_lens[:4], err)
    return len(ctx.plan_groups)

# Ragged prefills (no prefix), GQA group 4, rows covering several tokens per block.
check(8, 2, 32, [0, 0, 0, 0], [1, 6, 17, 40])
# Group 3 (padded to 4), non power-of-two head_dim, catch-ups over prefixes of mixed length.
check(6, 2, 24, [5, 0, 33, 100, 2], [3, 9, 1, 12, 1], rows=32)
# Shared prefix: 5 requests read the same 70 slots, then their own tails.
check(4, 2, 16, [], [4, 1, 7, 2, 10], shared_prefix=70)
# A skewed batch (one long prefill among decode rows): several torch groups, one kernel launch.
assert check(4, 1, 16, [0, 50, 60, 70, 80], [120, 1, 1, 1, 1]) >= 2
# Long contexts: catch-ups of 10 and 3 tokens at 8k and 4k, one plain prefill.
check(2, 1, 16, [8182, 4093, 0], [10, 3, 20], rows=16, block_n=64)
print("OK")
"""

SPLIT = r"""
# Split-KV varlen (flash-decoding style) against the torch path and against one split.
from tokencache_models.kernels.varlen_attention import paged_varlen, varlen_grid

# The heuristic: 10 catch-ups x 10 tokens at 8k on the 8B shape (32 heads, 8 kv heads) make
# 80 programs, so they split; a long prefill or short contexts keep one split.
assert varlen_grid(10, 10, 32, 8, 10 * 8192)[3] == 4
assert varlen_grid(1, 8192, 32, 8, 8192)[3] == 1
assert varlen_grid(64, 10, 32, 8, 64 * 8192)[3] == 1
assert varlen_grid(10, 10, 32, 8, 10 * 100)[3] == 1


def with_empty_request(batch, at, kv_len, slot):
    # The batch's offsets with a q_len 0 request of kv_len slots inserted before request `at`.
    qo, ko = batch.q_offsets, batch.kv_offsets
    q_off = torch.cat((qo[: at + 1], qo[at:]))
    kv_off = torch.cat((ko[: at + 1], ko[at:] + kv_len))
    fill = torch.full((kv_len,), slot, dtype=batch.kv_slots.dtype)
    kv_slots = torch.cat((batch.kv_slots[: ko[at]], fill, batch.kv_slots[ko[at] :]))
    return kv_slots, q_off, kv_off[:-1], kv_off.diff()


def check(heads, kv_heads, head_dim, prefix_lens, q_lens, splits, shared_prefix=0, rows=16,
          block_n=16, dtype=torch.float32, empty_at=None):
    # Returns the split count paged_varlen picks by itself for this batch.
    total = sum(prefix_lens) + sum(q_lens) + shared_prefix + 8
    kc = torch.randn(total + 1, kv_heads, head_dim).to(dtype)
    vc = torch.randn(total + 1, kv_heads, head_dim).to(dtype)
    perm = torch.randperm(total)
    shared = None
    if shared_prefix:
        shared, perm = perm[-shared_prefix:], perm[:-shared_prefix]
        prefix_lens = [shared_prefix] * len(q_lens)
    pre, new = scattered_requests(perm, prefix_lens, q_lens, shared)
    batch = ForwardBatch.from_requests([[0] * n for n in q_lens], pre, new)
    q = torch.randn(batch.num_tokens, heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    ref, ctx = torch_reference(batch, q, kc, vc, scale)
    tables = (batch.kv_slots, batch.q_offsets, batch.kv_starts, batch.kv_lens)
    if empty_at is not None:
        tables = with_empty_request(batch, empty_at, 40, int(perm[0]))
    tol = 1e-5 if dtype == torch.float32 else 3e-2

    def run(n):
        out = paged_varlen(q, kc, vc, *tables, scale, ctx.max_q_len, rows=rows,
                           block_n=block_n, splits=n)
        assert not out.isnan().any(), n
        return out.float()

    one = run(1)
    assert (one - ref.float()).abs().max().item() < tol
    for n in splits:
        out = run(n)
        for base in (ref.float(), one):
            err = (out - base).abs().max().item()
            assert err < tol, (heads, kv_heads, prefix_lens[:4], q_lens[:4], n, err)
    kv_total = tables[0].numel()
    return varlen_grid(len(tables[1]) - 1, ctx.max_q_len, heads, kv_heads, kv_total, rows,
                       block_n)[3]


# Ragged, page-scattered: q_len 1, a q_len past one block (8 tokens of 2 heads), prefixes from
# none to several splits; short rows leave later splits empty (more splits than chunks).
check(2, 1, 16, [0, 5, 33, 200], [1, 12, 3, 17], splits=[5])
# Group 3 (padded to 4), odd head_dim, a q_len 0 request among them.
check(3, 1, 24, [40, 0, 90], [5, 2, 9], splits=[3], empty_at=1)
# Shared prefix: 4 requests read the same 150 slots, then their own tails.
check(2, 1, 16, [], [1, 9, 4, 2], splits=[4], shared_prefix=150)
# Catch-ups of 10 tokens at 4k, 2k and 300 slots: the automatic choice splits (8 ways; the
# 300-slot request fills 5 splits of 64 and leaves 3 empty).
auto = check(2, 1, 16, [4086, 1990, 290], [10, 10, 10], splits=[None], block_n=64)
assert auto == 8, auto
# bf16 is left out: this triton's interpreter gets bf16 tl.dot wrong (decode kernel too).
print("OK")
"""

PREFIX = r"""
# Shared-prefix (cascade) attention: groups of rows whose slot lists start with the same slots
# read them once through the prefix kernel; the per-row kernels skip them; one merge. Against
# the torch path (every row reads its whole list) and against the kernels without the prefix
# path.
from tokencache_models.forward.context import HostBatch, SharedPrefix
from tokencache_models.shared_prefix.groups import find_prefix_groups, max_tiles, prefix_tables
from tokencache_models.kernels.decode_attention import paged_decode
from tokencache_models.kernels.varlen_attention import paged_varlen
import tokencache_models.kernels.shared_prefix_attention as triton_prefix

def build(segments, rows, tails, q_lens, kv_heads, head_dim):
    # Row i's slot list: the named prompt segments rows[i] (page-scattered slots every row
    # naming them shares), then tails[i] slots of its own, then q_lens[i] new ones.
    total = sum(segments.values()) + sum(tails) + sum(q_lens) + 8
    kc = torch.randn(total + 1, kv_heads, head_dim)
    vc = torch.randn(total + 1, kv_heads, head_dim)
    perm, seg, o = torch.randperm(total), {}, 0
    for name, n in segments.items():
        seg[name], o = perm[o : o + n], o + n
    own, new = scattered_requests(perm[o:], tails, q_lens)
    pre = [torch.cat([seg[x] for x in r] + [t]) for r, t in zip(rows, own)]
    return ForwardBatch.from_requests([[0] * n for n in q_lens], pre, new), kc, vc


def concatenated(hb):
    # The host batch's rows as one concatenated slot list and its offsets (padding rows each
    # get their own copy of the scratch entry).
    rows = [hb.kv_slots[s : s + n] for s, n in zip(hb.kv_starts.tolist(), hb.kv_lens.tolist())]
    return np.concatenate(rows), np.concatenate(([0], np.cumsum(hb.kv_lens)))


def on_device(tables, shape):
    groups = tables.groups
    return SharedPrefix(*(torch.from_numpy(a) for a in tables.arrays()), shape.tokens_per_block,
                        groups=groups, skipped=sum(len(g.rows) * g.length for g in groups),
                        longest=max((g.length for g in groups), default=0))


def check(heads, kv_heads, head_dim, segments, rows, tails, q_lens, expect, pad=0):
    batch, kc, vc = build(segments, rows, tails, q_lens, kv_heads, head_dim)
    hb = HostBatch.from_batch(batch)
    if pad:
        hb = hb.padded(len(q_lens) + pad, kc.shape[0] - 1)
    n = len(q_lens)
    kv_slots, kv_offsets = concatenated(hb)
    groups = find_prefix_groups(kv_slots, kv_offsets, hb.q_offsets, n, min_len=1)
    assert [(g.rows, g.length) for g in groups] == expect, groups
    q = torch.randn(len(hb.token_ids), heads, head_dim)
    scale = head_dim**-0.5
    ref_batch = ForwardBatch(*(torch.from_numpy(a) for a in (
        hb.token_ids, hb.positions, hb.out_slots, hb.q_offsets, kv_slots, kv_offsets)))
    ref, ctx = torch_reference(ref_batch, q, kc, vc, scale)
    slots, q_off, kv_off = ref_batch.kv_slots, ref_batch.q_offsets, ref_batch.kv_offsets
    shape = triton_prefix.prefix_shape(q, kc)
    tables = [
        prefix_tables(groups, hb.q_offsets, kv_offsets, shape),
        # A graph's table: padded with empty tiles up to its fixed count (two more groups').
        prefix_tables(groups, hb.q_offsets, kv_offsets, shape,
                      max_tiles(shape, len(hb.token_ids), len(groups) + 2)),
        # No group on the prefix path: no tile; every row writes its prefix columns empty.
        prefix_tables([], hb.q_offsets, kv_offsets, shape),
    ]
    outs = []
    for prefix in [on_device(t, shape) for t in tables] + [None]:
        if ctx.is_decode:
            outs.append(paged_decode(q, kc, vc, slots, kv_off[:-1], kv_off.diff(), scale,
                                     block_n=16, prefix=prefix))
        else:
            outs.append(paged_varlen(q, kc, vc, slots, q_off, kv_off[:-1], kv_off.diff(), scale,
                                     ctx.max_q_len,
                                     rows=16, block_n=16, prefix=prefix))
    real = int(q_off[n])  # padding rows are computed and dropped
    for out in outs:
        assert not out[:real].isnan().any()
        err = (out[:real] - ref[:real]).abs().max().item()
        assert err < 1e-4, (heads, kv_heads, segments, rows[:4], q_lens[:4], err)


A = {"A": 200}
# Decode, one prompt for all, GQA 4 and 3 (padded to 4), odd head_dim; tails from none to
# several blocks.
check(8, 2, 32, A, [["A"]] * 5, [0, 5, 64, 130, 1], [1] * 5, [((0, 1, 2, 3, 4), 200)])
check(6, 2, 24, {"A": 77}, [["A"]] * 3, [3, 0, 40], [1] * 3, [((0, 1, 2), 77)])
# Decode with padding rows (a CUDA-graph bucket): outside every group, they keep their slot.
check(4, 2, 16, {"A": 150}, [["A"]] * 3, [2, 9, 30], [1] * 3, [((0, 1, 2), 150)], pad=5)
# Long shared prefix (~8k), short tails, as a shared system prompt at 8k context.
check(2, 1, 16, {"A": 8150}, [["A"]] * 4, [31, 12, 40, 7], [1] * 4, [((0, 1, 2, 3), 8150)])
# Two prompts interleaved with rows on none (and one row alone on a third).
two = {"A": 130, "B": 90, "C": 70}
rows = [["A"], ["B"], [], ["A"], ["B"], ["C"], ["A"]]
check(4, 2, 16, two, rows, [3, 0, 5, 17, 2, 4, 1], [1] * 7, [((0, 3, 6), 130), ((1, 4), 90)])
# Nested prompts, the first row on the outer one only: the three on A + B group without it.
nest = {"A": 70, "B": 120}
check(4, 2, 16, nest, [["A"], ["A", "B"], ["A", "B"], ["A", "B"]], [5, 1, 2, 3], [1] * 4,
      [((1, 2, 3), 190)])
# Catch-ups (several new tokens each) over shared prefixes; one with no own tail.
check(4, 2, 16, {"A": 300}, [["A"]] * 3, [0, 17, 3], [5, 12, 1], [((0, 1, 2), 300)])
check(2, 1, 16, {"A": 2000}, [["A"]] * 2, [100, 4], [10, 10], [((0, 1), 2000)])
check(4, 2, 16, two, [["B"], ["A"], ["B"], ["A"], []], [2, 0, 9, 4, 6], [3, 7, 1, 2, 4],
      [((0, 2), 90), ((1, 3), 130)])
# The 16-bit caches' tile (128 rows: 64 tokens of a group of 2) on fp32 data: 70 decode rows
# in two groups, each spanning two tiles.
from tokencache_models.shared_prefix.shape import PrefixShape
real_prefix_shape = triton_prefix.prefix_shape
triton_prefix.prefix_shape = lambda q, k: PrefixShape(q.shape[1] // k.shape[1], k.shape[1],
                                                      q.shape[2], itemsize=2)
check(4, 2, 16, {"A": 90}, [["A"]] * 70, [i % 5 for i in range(70)], [1] * 70,
      [(tuple(range(70)), 90)])
rows = [["A"] if i % 3 else ["B"] for i in range(70)]
check(4, 2, 16, {"A": 90, "B": 75}, rows, [i % 4 for i in range(70)], [1] * 70,
      [(tuple(i for i in range(70) if i % 3 == 0), 75),
       (tuple(i for i in range(70) if i % 3), 90)])
check(4, 2, 16, {"A": 90}, [["A"]] * 3, [3, 0, 9], [40, 30, 2], [((0, 1, 2), 90)])
# Rows that diverge inside the prefix: a group's P is their common part only.
batch, kc, vc = build({"A": 100}, [["A"]] * 2, [10, 10], [1, 1], 1, 16)
slots = batch.kv_slots.clone()
off = int(batch.kv_offsets[1])
slots[off + 60] = int(slots[0])  # row 1 differs from row 0 at index 60
args = (slots.numpy(), batch.kv_offsets.numpy(), batch.q_offsets.numpy())
assert [(g.rows, g.length) for g in find_prefix_groups(*args, min_len=1)] == [((0, 1), 60)]
assert find_prefix_groups(*args, min_len=64) == []
# Tables cut for another tile than the kernel's are refused (tokens would be lost).
from tokencache_models.shared_prefix.shape import PrefixShape as _Shape
batch, kc, vc = build({"A": 100}, [["A"]] * 2, [3, 4], [1, 1], 2, 16)
hb = HostBatch.from_batch(batch)
q = torch.randn(2, 4, 16)
wrong = _Shape(1, 2, 16)  # 128 tokens per tile; the (patched) kernel's takes 64
kv_off = batch.kv_offsets.numpy()
bad = on_device(prefix_tables(find_prefix_groups(hb.kv_slots, kv_off, hb.q_offsets, min_len=1),
                              hb.q_offsets, hb.kv_starts, wrong), wrong)
try:
    paged_decode(q, kc, vc, batch.kv_slots, batch.kv_starts, batch.kv_lens, 0.25, block_n=16,
                 prefix=bad)
    raise AssertionError("a table cut for another tile ran")
except ValueError as e:
    assert "tokens per tile" in str(e)
triton_prefix.prefix_shape = real_prefix_shape

# Whole model: four requests on one 100-token system prompt and two on a 200-token one, decode
# and catch-up steps through the Triton backend (prefix path on) against the torch backend, then
# the padded static decode path (what a CUDA graph replays) against eager.
import dataclasses
from tokencache_models import QWEN3_0_6B, GreedyRunner, random_model
from tokencache_models.executor.decode_graphs import DecodeGraphRunner

cfg = dataclasses.replace(
    QWEN3_0_6B, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
runners = []
system = [int(t) for t in torch.randint(0, 64, (100,))]
other = [int(t) for t in torch.randint(0, 64, (200,))]
for backend in ("triton", "torch"):
    model = random_model(cfg, seed=0, std=0.2, attention_backend=backend)
    r = GreedyRunner(model, model.make_kv_pool(1024))
    first, second = r.add_request(system + [1, 2, 3]), r.add_request(other + [5])
    r.step([first, second])
    rids = [first] + [r.add_request(system + [4 + i] * (i + 1), first, 100) for i in range(3)]
    rids[2:2] = [second, r.add_request(other + [9, 9], second, 200)]
    runners.append((model, r, rids))
(tm, tr, rids), (_, rr, _) = runners
late = [i for i in rids if i not in (first, second)]
tr.step(late), rr.step(late)  # the others' own prompt tails
shared_seen = []
for step in range(4):
    if step == 2:  # a catch-up: two requests get three tokens each from "the large model"
        for run in (tr, rr):
            run.extend(rids[0], [7, 8, 9])
            run.extend(rids[2], [10, 11, 12])
    batch = ForwardBatch.from_requests(
        [tr.requests[i].pending for i in rids], [tr.requests[i].slots for i in rids],
        [torch.zeros(len(tr.requests[i].pending), dtype=torch.int64) for i in rids])
    prefix = tm.executor.build_context(batch, tr.pool, tm.attention()).prefix
    shared_seen.append(sorted(g.length for g in prefix.groups) if prefix else [])
    a, b = tr.step(rids), rr.step(rids)
    err = (a.logits - b.logits).abs().max().item()
    assert err < 1e-4, (step, err)
    assert a.logits.argmax(-1).tolist() == b.logits.argmax(-1).tolist()
assert shared_seen == [[100, 200]] * 4, shared_seen  # the prefix path ran in every step
hb = HostBatch.from_batch(ForwardBatch.from_requests(
    [tr.requests[i].pending for i in rids], [tr.requests[i].slots for i in rids],
    [tr.pool.alloc(1) for _ in rids]))
static = DecodeGraphRunner(tm, tr.pool, tm.attention(), (8,), use_graphs=False).run(hb)
eager = tm.run(tm.executor.build_context(hb, tr.pool, tm.attention()), tr.pool, tm.attention())
assert (static.logits - eager.logits).abs().max().item() < 1e-4
print("OK")
"""

NO_SYNC = r"""
# The Triton path's host code reads no device value back: run a forward of a tiny model on the
# interpreter with the sync methods of torch.Tensor patched to raise once the context is built.
import dataclasses
from tokencache_models import QWEN3_0_6B, random_model

cfg = dataclasses.replace(
    QWEN3_0_6B, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
model = random_model(cfg, seed=0, std=0.2, attention_backend="triton")
ref_model = random_model(cfg, seed=0, std=0.2, attention_backend="torch")
pool, ref_pool = model.make_kv_pool(512), ref_model.make_kv_pool(512)
a, b, system = pool.alloc(9), pool.alloc(4), pool.alloc(200)
rows = [pool.alloc(1) for _ in range(4)]
for batch, shared in (
    (ForwardBatch.from_requests([list(range(9)), [1, 2, 3, 4]], [[], []], [a, b]), 0),
    (ForwardBatch.from_requests([[5], [6]], [a, b], [pool.alloc(1), pool.alloc(1)]), 0),
    # A 200-token system prompt, then four requests decoding over it: the shared-prefix path.
    (ForwardBatch.from_requests([[i % 64 for i in range(200)]], [[]], [system]), 0),
    (ForwardBatch.from_requests([[7], [8], [9], [10]], [system] * 4, rows), 200),
):
    ref = ref_model(batch, ref_pool)
    backend = model.attention()
    ctx = model.executor.build_context(batch, pool, backend)
    assert (ctx.prefix.longest if ctx.prefix else 0) == shared, (ctx.prefix, shared)
    saved = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "numpy")}

    def refuse(*args, **kwargs):
        raise AssertionError("host sync inside the forward body")

    for n in saved:
        setattr(torch.Tensor, n, refuse)
    try:
        out = model.run(ctx, pool, backend)
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
    err = (out.logits - ref.logits).abs().max().item()
    assert err < 1e-4, err
print("OK")
"""


FUSED = r"""
# Each Triton fusion against the unfused torch modules it replaces, then whole forwards.
import dataclasses
from torch.nn import functional as F
from tokencache_models import QWEN3_0_6B, random_model
from tokencache_models.config import ModelConfig
from tokencache_models.kernels.fused import add_rmsnorm, qkv_norm_rope_store, silu_mul
from tokencache_models.layers import RMSNorm, RotaryEmbedding, apply_rope

def close(a, b, dtype):
    tol = 1e-5 if dtype == torch.float32 else 3e-2  # bf16: a rounding or two apart
    err = (a.float() - b.float()).abs().max().item()
    assert err <= tol * max(1.0, b.float().abs().max().item()), (dtype, err)

for dtype in (torch.float32, torch.bfloat16):
    norm = RMSNorm(48, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    x, r = torch.randn(7, 48).to(dtype), torch.randn(7, 48).to(dtype)
    y, res = add_rmsnorm(x, r, norm.weight.detach(), norm.eps)
    if dtype == torch.float32:
        assert torch.equal(res, x + r)  # the residual add rounds as torch's
    else:  # the interpreter truncates fp32 -> bf16 (GPUs round to nearest): one ulp apart
        close(res, x + r, dtype)
    close(y, norm(x + r).detach(), dtype)
    y, res = add_rmsnorm(x, None, norm.weight.detach(), norm.eps)
    assert res is x
    close(y, norm(x).detach(), dtype)

    # q/k norms + RoPE + the K/V write from a merged projection (4 q heads, 2 kv heads, GQA 2;
    # a row stride wider than the row, as a view would have), into scattered pool rows of a
    # cache in the model dtype and in fp32 (the cast absorbed).
    cfg = ModelConfig("qwen3", 10, 32, 64, 1, 4, 2, head_dim=16, rope_theta=1e6)
    rot = RotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 2, 700, 8191, 5, 4096])
    slots = torch.tensor([9, 3, 17, 0, 12, 5, 30])
    qkv = torch.randn(7, 8 * 16 + 5).to(dtype)[:, : 8 * 16]
    q, k, v = (t.reshape(7, -1, 16) for t in qkv.split((64, 32, 32), dim=-1))
    qn, kn = RMSNorm(16, 1e-6).to(dtype), RMSNorm(16, 1e-6).to(dtype)
    with torch.no_grad():
        qn.weight.normal_(1.0, 0.3)
        kn.weight.normal_(1.0, 0.3)
    cos, sin = rot(pos, dtype)
    inv = rot.inv_freq(torch.device("cpu"))
    for cache_dtype in (dtype, torch.float32):
        for norms in ((qn, kn), (None, None)):
            kc = torch.zeros(33, 2, 16, dtype=cache_dtype)
            vc = torch.zeros(33, 2, 16, dtype=cache_dtype)
            qw, kw = (n.weight.detach() if n is not None else None for n in norms)
            got = qkv_norm_rope_store(qkv, 4, 2, pos, slots, inv, qw, kw, 1e-6, kc, vc)
            q_ref = qn(q).detach() if norms[0] is not None else q
            k_ref = kn(k).detach() if norms[1] is not None else k
            assert got.dtype == cache_dtype and got.shape == (7, 4, 16)
            close(got, apply_rope(q_ref, cos, sin), dtype)
            close(kc[slots], apply_rope(k_ref, cos, sin), dtype)
            assert torch.equal(vc[slots], v.to(cache_dtype))
            untouched = torch.ones(33, dtype=torch.bool)
            untouched[slots] = False
            assert not kc[untouched].any() and not vc[untouched].any()

    # silu(gate) * up read from the merged [T, 2I] output, through a strided view.
    gu = torch.randn(5, 2 * 96 + 3).to(dtype)[:, : 2 * 96]
    g, u = gu.chunk(2, dim=-1)
    close(silu_mul(gu), F.silu(g) * u, dtype)

base = dataclasses.replace(
    QWEN3_0_6B, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
)
# Qwen3 (fused q/k norms) and Qwen2 (q/k/v biases, no norms) with the Triton attention, Llama
# (RoPE only) with the torch one: prefill, a catch-up over the cached context, decode.
families = (
    (base, "triton"),
    (dataclasses.replace(base, model_type="qwen2"), "triton"),
    (dataclasses.replace(base, model_type="llama"), "torch"),
)
for cfg, backend in families:
    model = random_model(cfg, seed=0, std=0.2, attention_backend=backend)
    pools = [model.make_kv_pool(64), model.make_kv_pool(64)]
    a, b = pools[0].alloc(9), pools[0].alloc(4)
    a2, b2 = pools[0].alloc(3), pools[0].alloc(3)
    d1, d2 = pools[0].alloc(1), pools[0].alloc(1)
    batches = (
        ForwardBatch.from_requests([list(range(9)), [1, 2, 3, 4]], [[], []], [a, b]),
        ForwardBatch.from_requests([[5, 6, 7], [8, 9, 10]], [a, b], [a2, b2]),
        ForwardBatch.from_requests(
            [[5], [6]], [torch.cat((a, a2)), torch.cat((b, b2))], [d1, d2]
        ),
    )
    for batch in batches:
        outs = []
        for fused, pool in zip((False, True), pools):
            model.fused = fused
            outs.append(model(batch, pool))
        err = (outs[0].logits - outs[1].logits).abs().max().item()
        assert err < 1e-4, (cfg.model_type, backend, err)
        assert torch.equal(outs[0].logits.argmax(-1), outs[1].logits.argmax(-1))
        assert (outs[0].hidden - outs[1].hidden).abs().max().item() < 1e-4
    assert torch.allclose(pools[0].k, pools[1].k, atol=1e-5)
    assert torch.allclose(pools[0].v, pools[1].v, atol=1e-5)
print("OK")
"""


def _run(script: str) -> None:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "integrations")}
    proc = subprocess.run(
        [sys.executable, "-c", COMMON + script],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        # Under pytest's own 900 s: the interpreter runs each kernel in Python, and the
        # shared-prefix script passed 300 s on a slow shared VM (2026-12-02).
        timeout=840,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_triton_decode_kernel_in_interpreter() -> None:
    _run(DECODE)


def test_triton_varlen_kernel_in_interpreter() -> None:
    _run(VARLEN)


def test_triton_varlen_split_kv_in_interpreter() -> None:
    _run(SPLIT)


def test_triton_shared_prefix_attention_in_interpreter() -> None:
    _run(PREFIX)


def test_triton_fusions_match_the_unfused_path_in_interpreter() -> None:
    _run(FUSED)


@pytest.mark.parametrize("script", [NO_SYNC], ids=["forward"])
def test_triton_forward_has_no_host_sync_in_interpreter(script: str) -> None:
    _run(script)
