"""The forward's epilogue: greedy tokens, entropy and an entropy router's answer computed on the
device, equal to what the host-side code computes from the same logits, on every path (eager,
padded static, meta)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tokencache_models import (
    QWEN3_0_6B,
    Epilogue,
    ForwardBatch,
    ForwardOutput,
    HostBatch,
    KVPool,
    empty_model,
    random_model,
)
from tokencache_models.executor.decode_graphs import DecodeGraphRunner
from tokencache_routing.core.routers import RouterFeatures

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


def _host_entropy(logits: torch.Tensor) -> torch.Tensor:
    """What the router computes on the host when no epilogue did (RouterFeatures.entropy)."""
    empty = torch.zeros(0)
    return RouterFeatures(logits, empty, empty, empty, empty).entropy


@pytest.mark.parametrize("vocab", [96, 90, 1])
def test_apply_equals_the_host_computation(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, 96, generator=g) * 4
    logits[3, vocab - 1] = logits[3].max() + 1  # a row whose argmax is the last token kept
    if vocab < 96:
        logits[5, vocab:] = 100.0  # padding columns: never drawn, never in the entropy
    out = Epilogue(vocab, entropy=True).apply(ForwardOutput(logits, torch.zeros(7, 4)))
    kept = logits[:, :vocab]
    assert out.greedy is not None and out.entropy is not None
    assert torch.equal(out.greedy, kept.argmax(-1))
    assert torch.equal(out.entropy, _host_entropy(kept))  # bit for bit: the same operations
    assert out.greedy[3] == vocab - 1
    assert torch.equal(out.logits, logits)  # the logits themselves are left as they were
    plain = Epilogue(vocab).apply(ForwardOutput(logits, torch.zeros(7, 4)))
    assert plain.entropy is None and torch.equal(plain.greedy, out.greedy)  # type: ignore[arg-type]


@pytest.mark.parametrize("threshold", [0.0, 1.7, 4.1, float("inf")])
def test_escalate_is_the_entropy_routers_answer(threshold: float) -> None:
    """escalate_at: the router's own comparison on the same entropy (bit for bit), rows and
    padding columns as for the entropy; a threshold at a row's entropy escalates it (>=)."""
    from tokencache_routing import EntropyRouter

    logits = torch.randn(9, 96, generator=torch.Generator().manual_seed(2)) * 3
    logits[4] = 0.0  # uniform: entropy log(90), > every finite threshold here
    out = Epilogue(90, entropy=True, escalate_at=threshold).apply(
        ForwardOutput(logits, torch.zeros(9, 4))
    )
    empty = torch.zeros(0)
    routed = EntropyRouter(threshold).route(
        RouterFeatures(logits[:, :90], empty, empty, empty, empty)
    )
    assert out.escalate is not None and out.escalate.dtype == torch.bool
    assert torch.equal(out.escalate, routed)
    assert out.escalate[4] == (threshold < float("inf"))
    assert out.entropy is not None
    at = Epilogue(90, entropy=True, escalate_at=float(out.entropy[2])).apply(
        ForwardOutput(logits, torch.zeros(9, 4))
    )
    assert at.escalate is not None and bool(at.escalate[2])
    sel = out.rows(torch.tensor([4, 1]))
    assert sel.escalate is not None and sel.escalate.tolist() == out.escalate[[4, 1]].tolist()
    assert (
        Epilogue(90, entropy=True).apply(ForwardOutput(logits, torch.zeros(9, 4))).escalate is None
    )


def test_bad_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab must be >= 1"):
        Epilogue(0)
    with pytest.raises(ValueError, match="logits have 8"):
        Epilogue(9).apply(ForwardOutput(torch.zeros(2, 8), torch.zeros(2, 4)))
    with pytest.raises(ValueError, match="needs entropy=True"):
        Epilogue(9, escalate_at=0.5)


def test_rows_keep_the_epilogue_values() -> None:
    out = Epilogue(5, entropy=True).apply(
        ForwardOutput(torch.randn(4, 5, generator=torch.Generator().manual_seed(1)), torch.eye(4))
    )
    sel = out.rows(torch.tensor([2, 0]))
    assert sel.greedy is not None and sel.entropy is not None and out.greedy is not None
    assert sel.greedy.tolist() == [out.greedy[2].item(), out.greedy[0].item()]
    assert torch.equal(sel.entropy, out.entropy[[2, 0]])  # type: ignore[index]
    assert torch.equal(sel.hidden, torch.eye(4)[[2, 0]])


def _decode_setup() -> tuple[object, KVPool, ForwardBatch]:
    model = random_model(CFG, seed=0, std=0.2, attention_backend="torch")
    pool = KVPool.for_config(CFG, 256)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, CFG.vocab_size, (n,), generator=g).tolist() for n in (9, 4, 13)]
    slots = [pool.alloc(len(p)) for p in prompts]
    model(ForwardBatch.from_requests(prompts, [[]] * 3, slots), pool)
    new = [pool.alloc(1) for _ in prompts]
    batch = ForwardBatch.from_requests([[5], [6], [7]], slots, new)
    return model, pool, batch


@pytest.mark.parametrize("path", ["eager", "static"])
def test_forward_paths_compute_it_from_their_own_logits(path: str) -> None:
    model, pool, batch = _decode_setup()
    e = Epilogue(90, entropy=True)
    if path == "eager":
        out = model.execute(model.prepare(batch, pool, epilogue=e))  # type: ignore[attr-defined]
    else:
        runner = DecodeGraphRunner(model, pool, model.attention(), (4,), use_graphs=False)  # type: ignore[arg-type, attr-defined]
        hb = HostBatch.from_batch(batch)
        step = runner.prepare(hb, e)
        assert step.key[-1] == e and runner.prepare(hb).key[-1] is None  # keyed by epilogue
        out = runner.execute(step)
    assert out.greedy is not None and out.entropy is not None
    assert out.greedy.shape == (3,) and out.entropy.shape == (3,)  # real rows only
    assert torch.equal(out.greedy, out.logits[:, :90].argmax(-1))
    assert torch.equal(out.entropy, _host_entropy(out.logits[:, :90]))


def test_epilogue_never_reads_the_device() -> None:
    """On meta (no data) any host read in the epilogue would raise: it is device work."""
    model = empty_model(CFG, device="meta", attention_backend="torch")
    pool = KVPool.for_config(CFG, 64, device="meta")
    a, b = pool.alloc(5), pool.alloc(3)
    batch = ForwardBatch.from_requests([[1], [2]], [a[:-1], b[:-1]], [a[-1:], b[-1:]])
    runner = DecodeGraphRunner(model, pool, model.attention(), (2,), use_graphs=False)
    out = runner.run(HostBatch.from_batch(batch), Epilogue(CFG.vocab_size, entropy=True))
    assert out.greedy is not None and out.greedy.device.type == "meta"
    assert out.entropy is not None and out.entropy.shape == (2,)


def test_draw_takes_the_forwards_greedy_tokens_and_leaves_them_alone() -> None:
    """draw() gives greedy rows the epilogue's tokens (here deliberately not the argmax, to
    tell them apart) and writes its sampled rows over a copy of them, never into them."""
    from tokencache_routing import SamplingParams
    from tokencache_routing.core.sampling import draw
    from tokencache_routing.core.state import Request

    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    greedy = (logits.argmax(-1) + 1) % 16
    before = greedy.clone()
    reqs = [
        Request(i, i, np.array([1, 2]), 4, SamplingParams(temperature=t, seed=i), frozenset())
        for i, t in enumerate((0.0, 1.0, 0.0))
    ]
    sampled = np.array([False, True, False])
    d = draw(logits, reqs, np.array([2, 2, 2]), sampled, greedy)
    assert torch.equal(greedy, before)
    tokens, failed = d.resolve(reqs)
    assert not failed and tokens[0] == before[0] and tokens[2] == before[2]
    host, _ = draw(logits, reqs, np.array([2, 2, 2]), sampled).resolve(reqs)  # argmax here
    assert host[1] == tokens[1]  # the sampled row is the same draw either way
    assert [host[0], host[2]] == logits.argmax(-1)[[0, 2]].tolist() != [tokens[0], tokens[2]]
