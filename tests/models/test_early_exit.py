"""The early-exit small model: first k layers + a fitted exit head, through the paged runner.

Checked against a plain torch reference of the same computation (transformers' Llama hidden
state after layer k, then the head and the lm_head), the least-squares fit, the checkpoint
round trip and refusals, and greedy_trace against a no-cache recomputation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tokencache_models import ForwardBatch, from_transformers, random_model, truncate_model
from tokencache_models.early_exit import (
    ExitHead,
    distill_exit_head,
    early_exit_model,
    fit_exit_head,
    greedy_trace,
    load_early_exit,
    load_exit_head,
    save_exit_head,
)
from tokencache_models.layers import RMSNorm

K = 2  # layers kept of the tiny checkpoints' 3


@pytest.fixture(scope="module")
def hf_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.08,
        tie_word_embeddings=True,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()


def random_head(dim: int, eps: float, seed: int) -> ExitHead:
    """A head far from the identity, so that a runner ignoring it would be caught."""
    g = torch.Generator().manual_seed(seed)
    head = ExitHead(dim, eps)
    with torch.no_grad():
        head.weight.copy_(1 + 0.5 * torch.rand(dim, generator=g))
        head.proj.weight.copy_(torch.randn(dim, dim, generator=g) / dim**0.5)
        head.proj.bias.copy_(0.3 * torch.randn(dim, generator=g))
    return head


@torch.no_grad()
def reference_logits(hf: Any, head: ExitHead, ids: list[int]) -> torch.Tensor:
    """Plain torch: transformers' residual stream after layer K, the head, the lm_head."""
    out = hf(torch.tensor([ids]), output_hidden_states=True)
    x = out.hidden_states[K][0]  # [T, H]: hidden_states[0] is the embedding
    ref: torch.Tensor = hf.lm_head(head(x))
    return ref


def runner_logits_per_position(model: Any, ids: list[int]) -> torch.Tensor:
    """Our runner: a prefill of the first 3 tokens, then one paged decode step per token."""
    pool = model.make_kv_pool(len(ids))
    slots = pool.alloc(3)
    out = model(ForwardBatch.from_requests([ids[:3]], [[]], [slots]), pool)
    rows = [out.logits[0]]
    for t in ids[3:]:
        new = pool.alloc(1)
        out = model(ForwardBatch.from_requests([[t]], [slots], [new]), pool)
        slots = torch.cat((slots, new))
        rows.append(out.logits[0])
    return torch.stack(rows)


def test_early_exit_runner_equals_torch_reference(hf_llama: Any) -> None:
    large = from_transformers(hf_llama, attention_backend="torch")
    head = random_head(64, large.model.norm.eps, seed=3)
    small = early_exit_model(large, K, head)
    assert len(small.model.layers) == K and small.model.norm is head
    ids = torch.randint(0, 320, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    got = runner_logits_per_position(small, ids)
    ref = reference_logits(hf_llama, head, ids)[2:]
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    # The head matters: plain truncation gives other logits.
    plain = runner_logits_per_position(truncate_model(large, K), ids)
    assert (plain - ref).abs().max() > 0.1
    # A batch of two requests (ragged) gives each its own reference row.
    pool = small.make_kv_pool(20)
    a, b = ids[:7], ids[3:12]
    out = small(ForwardBatch.from_requests([a, b], [[], []], [pool.alloc(7), pool.alloc(9)]), pool)
    torch.testing.assert_close(
        out.logits[0], reference_logits(hf_llama, head, a)[-1], atol=1e-4, rtol=1e-4
    )
    torch.testing.assert_close(
        out.logits[1], reference_logits(hf_llama, head, b)[-1], atol=1e-4, rtol=1e-4
    )
    # out.hidden (what a router reads) is the head's output.
    with torch.no_grad():
        x = hf_llama(torch.tensor([b]), output_hidden_states=True).hidden_states[K][0, -1]
        torch.testing.assert_close(out.hidden[1], head(x), atol=1e-5, rtol=1e-5)


def test_fit_recovers_an_affine_map_and_beats_truncation() -> None:
    g = torch.Generator().manual_seed(0)
    dim, n = 16, 400
    norm = RMSNorm(dim, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(1 + torch.rand(dim, generator=g))
    x = 3 * torch.randn(n, dim, generator=g)
    w = torch.randn(dim, dim, generator=g) / 4
    b = torch.randn(dim, generator=g)
    y = norm(x) @ w.T + b
    head = fit_exit_head(norm, x, y, ridge=0.0)
    with torch.no_grad():
        torch.testing.assert_close(head(x), y, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(head.proj.weight, w, atol=1e-4, rtol=1e-4)
    # Noisy targets: the fit is still far closer than the plain norm (truncation).
    y_noisy = y + 0.1 * torch.randn(n, dim, generator=g)
    fitted = fit_exit_head(norm, x, y_noisy)
    with torch.no_grad():
        err = (fitted(x) - y).pow(2).mean()
        err_trunc = (norm(x) - y).pow(2).mean()
    assert err < 0.05 * err_trunc
    # A huge ridge pulls the map back to the identity: plain truncation plus a bias.
    stiff = fit_exit_head(norm, x, y, ridge=1e9)
    torch.testing.assert_close(stiff.proj.weight, torch.eye(dim), atol=1e-3, rtol=0)


def test_checkpoint_round_trip_and_refusals(hf_llama: Any, tmp_path: Path) -> None:
    large = from_transformers(hf_llama, attention_backend="torch")
    head = random_head(64, large.model.norm.eps, seed=4)
    path = tmp_path / "head.pt"
    save_exit_head(path, K, head, {"note": "test"})
    k, loaded, meta = load_exit_head(path)
    assert k == K and meta == {"note": "test"}
    assert all(torch.equal(v, head.state_dict()[n]) for n, v in loaded.state_dict().items())
    ids = list(range(10, 19))
    want = runner_logits_per_position(early_exit_model(large, K, head), ids)
    got = runner_logits_per_position(load_early_exit(large, path), ids)
    assert torch.equal(got, want)
    # Wrong sizes or layer counts, and files that are not heads, are refused by name.
    save_exit_head(tmp_path / "wide.pt", K, ExitHead(32, 1e-6))
    with pytest.raises(ValueError, match="does not fit"):
        load_early_exit(large, tmp_path / "wide.pt")
    save_exit_head(tmp_path / "deep.pt", 3, head)
    with pytest.raises(ValueError, match="does not fit"):
        load_early_exit(large, tmp_path / "deep.pt")
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not an exit-head checkpoint"):
        load_exit_head(tmp_path / "other.pt")


@torch.no_grad()
def test_greedy_trace_matches_a_no_cache_recomputation() -> None:
    from tokencache_models import ModelConfig

    cfg = ModelConfig(
        model_type="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = random_model(cfg, seed=2, std=0.3, attention_backend="torch")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (3, 7, 5)]
    max_new = 6
    # eos: the second token of prompt 1's answer, so that answer stops early and others may.
    free = greedy_trace(model, prompts, max_new, [1, 2], None, batch_size=2)
    eos = free.answers()[1][1]
    trace = greedy_trace(model, prompts, max_new, [1, 2], eos, batch_size=2)
    captured: dict[int, torch.Tensor] = {}
    hooks = [
        model.model.layers[k - 1].register_forward_hook(
            lambda _m, _i, o, k=k: captured.__setitem__(k, o)
        )
        for k in (1, 2)
    ]
    try:
        for j, prompt in enumerate(prompts):
            rows = range(int(trace.offsets[j]), int(trace.offsets[j + 1]))
            seq = list(prompt)
            for r in rows:
                pool = model.make_kv_pool(len(seq))
                out = model(ForwardBatch.from_requests([seq], [[]], [pool.alloc(len(seq))]), pool)
                tok = int(out.logits.argmax(-1))
                assert int(trace.tokens[r]) == tok
                # Batched rows against one row alone: float32 sums in another order (and
                # another GEMM blocking with another thread count), so not bit for bit.
                torch.testing.assert_close(
                    trace.final_hidden[r], out.hidden[0], atol=1e-4, rtol=1e-4
                )
                for k in (1, 2):
                    torch.testing.assert_close(
                        trace.layer_hidden[k][r], captured[k][-1], atol=1e-4, rtol=1e-4
                    )
                seq.append(tok)
                if tok == eos:
                    assert r == rows[-1]  # eos ends the answer
            assert len(rows) == max_new or seq[-1] == eos
    finally:
        for h in hooks:
            h.remove()
    assert len(trace.answers()[1]) == 2 and trace.answers()[1][-1] == eos
    assert trace.rows([2, 0]).tolist() == [
        *range(int(trace.offsets[2]), int(trace.offsets[3])),
        *range(0, int(trace.offsets[1])),
    ]


def test_distillation_moves_the_small_tokens_towards_the_full_models() -> None:
    g = torch.Generator().manual_seed(3)
    dim, vocab, n = 16, 40, 600
    lm_head = torch.randn(vocab, dim, generator=g)
    norm = RMSNorm(dim, 1e-6)
    x = torch.randn(n, dim, generator=g)
    # The full model's hidden state: a nonlinear function of the layer-k state.
    y = torch.tanh(2 * norm(x) @ torch.randn(dim, dim, generator=g))
    head = fit_exit_head(norm, x, y)

    def kl_and_agreement(h: ExitHead) -> tuple[float, float]:
        with torch.no_grad():
            want = torch.log_softmax(y @ lm_head.T, -1)
            got = torch.log_softmax(h(x) @ lm_head.T, -1)
            kl = float(
                torch.nn.functional.kl_div(got, want, log_target=True, reduction="batchmean")
            )
            return kl, float((got.argmax(-1) == want.argmax(-1)).float().mean())

    kl0, agree0 = kl_and_agreement(head)
    seen: list[int] = []
    distill_exit_head(head, x, y, lm_head, epochs=30, lr=3e-3, batch_size=100, progress=seen.append)
    kl1, agree1 = kl_and_agreement(head)
    assert kl1 < 0.85 * kl0 and agree1 > agree0
    assert sum(seen) == 30 * n
    assert not any(p.requires_grad for p in head.parameters())  # left frozen, as loaded heads
