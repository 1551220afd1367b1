"""Routing quality: the agreement measures, the threshold sweep, the labels from a greedy trace,
and the offline curve against the real RoutedEngine on a tiny early-exit pair."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from routing_helpers import make_prompts, tiny_config

from tokencache_models import random_model
from tokencache_models.early_exit import ExitHead, early_exit_model, fit_exit_head, greedy_trace
from tokencache_routing import EngineConfig, EntropyRouter, RoutedEngine, Top1ProbRouter
from tokencache_routing.tools.labels import small_rows, split_prompts
from tokencache_routing.tools.quality import agreement, at_share, random_curve, sweep
from tokencache_routing.tools.train_router import load_features, train


def test_agreement_counts_tokens_before_the_first_kept_difference() -> None:
    offsets = [0, 3, 5, 9]
    differs = np.array([0, 1, 0, 1, 0, 0, 0, 1, 1], bool)
    escalate = np.array([0, 0, 0, 1, 0, 0, 0, 1, 0], bool)
    share, tok, exact = agreement(escalate, differs, offsets)
    # answer 0 stops at row 1; answer 1 escalated its difference: whole; answer 2 stops at 3.
    assert share == pytest.approx(2 / 9)
    assert tok == pytest.approx((1 + 2 + 3) / 9)
    assert exact == pytest.approx(1 / 3)
    # Escalating every difference reproduces the large model; escalating nothing is the small.
    assert agreement(differs, differs, offsets)[1:] == (1.0, 1.0)
    assert agreement(np.zeros(9, bool), differs, offsets)[1:] == pytest.approx((3 / 9, 0.0))


def test_sweep_hits_its_shares_and_an_oracle_beats_random() -> None:
    rng = np.random.default_rng(0)
    offsets = list(range(0, 2001, 20))
    differs = rng.random(2000) < 0.2
    noisy = differs + 0.8 * rng.random(2000)  # informative scores
    shares = (0.0, 0.1, 0.2, 0.5, 1.0)
    pts = sweep("oracle-ish", noisy, differs, offsets, shares)
    got = [p.share for p in pts]
    assert got == pytest.approx(list(shares), abs=1e-3)
    assert pts[0].token_agreement == agreement(np.zeros(2000, bool), differs, offsets)[1]
    assert pts[-1].token_agreement == 1.0 and pts[-1].exact_match == 1.0
    agree = [p.token_agreement for p in pts]
    assert agree == sorted(agree)  # escalating more never loses agreement here
    rand = random_curve(differs, offsets, shares)
    assert pts[2].token_agreement > rand[2].token_agreement + 0.3
    assert at_share(pts, 0.15) == pytest.approx(
        (pts[1].token_agreement + pts[2].token_agreement) / 2, abs=0.02
    )


def test_split_keeps_train_and_test_apart() -> None:
    tr, te = split_prompts(400)
    assert len(te) == 100 and not set(tr) & set(te) and sorted(tr + te) == list(range(400))
    assert split_prompts(8) == (list(range(6)), [6, 7])


@pytest.fixture(scope="module")
def early_exit_pair() -> tuple[Any, Any, list[list[int]], Any]:
    """A 3-layer random model, its first layer + an exit head fitted on its own generations."""
    torch.set_num_threads(1)
    large = random_model(tiny_config(3), seed=5, std=0.3, attention_backend="torch")
    prompts = make_prompts(24, seed=3)
    trace = greedy_trace(large, prompts, 10, [1], None, batch_size=8)
    head = fit_exit_head(large.model.norm, trace.layer_hidden[1], trace.final_hidden)
    return large, early_exit_model(large, 1, head), prompts, trace


def test_labels_are_the_small_models_differences(early_exit_pair: Any, tmp_path: Path) -> None:
    large, small, prompts, trace = early_exit_pair
    head = small.model.norm
    assert isinstance(head, ExitHead)
    rows = small_rows(large, head, trace.layer_hidden[1], trace.tokens, top_k=100)
    assert 0.05 < float(rows.label.mean()) < 0.95  # a real mix of agreeing and differing
    # Row by row, the small model itself (through the runner) at the large model's context.
    answers = trace.answers()
    from tokencache_models import ForwardBatch

    for j in (0, 5):
        seq = list(prompts[j])
        for i, tok in enumerate(answers[j]):
            r = int(trace.offsets[j]) + i
            pool = small.make_kv_pool(len(seq))
            out = small(ForwardBatch.from_requests([seq], [[]], [pool.alloc(len(seq))]), pool)
            assert int(out.logits.argmax()) == int(rows.small_tokens[r])
            assert bool(rows.label[r]) == (int(out.logits.argmax()) != tok)
            torch.testing.assert_close(rows.hidden[r], out.hidden[0], atol=1e-5, rtol=1e-5)
            seq.append(tok)
    # The files train_router reads.
    torch.save(rows.features(), tmp_path / "f.pt")
    feats = load_features([tmp_path / "f.pt"])
    assert feats["topk_logits"].shape == (len(rows.label), 96)
    router = train(feats, epochs=3, width=32, num_blocks=1)
    with torch.no_grad():
        s = torch.sigmoid(router(feats["hidden"], feats["token_emb"], feats["topk_logits"]))
    assert s.shape == rows.label.shape


def test_offline_curve_equals_the_real_engine(early_exit_pair: Any) -> None:
    """Before the first difference the engine's context is the large model's answer, so the
    offline agreement is what RoutedEngine produces with the same router and threshold."""
    large, small, prompts, trace = early_exit_pair
    head = small.model.norm
    rows = small_rows(large, head, trace.layer_hidden[1], trace.tokens)
    offsets = trace.offsets.tolist()
    differs = rows.label.numpy() > 0.5
    answers = trace.answers()
    checked = 0
    routers = (
        (rows.entropy.double().numpy(), EntropyRouter),  # escalates at entropy >= t
        (-rows.top1_prob.double().numpy(), lambda t: Top1ProbRouter(-t)),  # at top-1 < -t
    )
    for scores, make in routers:
        distinct = np.unique(scores)
        for share in (0.2, 0.5):
            # A threshold halfway between two scores: fp noise between the offline rows and the
            # engine's batches cannot flip a decision.
            i = int(np.searchsorted(distinct, np.quantile(scores, 1 - share)))
            thr = float((distinct[i - 1] + distinct[i]) / 2)
            _, tok, exact = agreement(scores >= thr, differs, offsets)
            res = RoutedEngine(
                small, large, make(thr), config=EngineConfig(num_slots=2048)
            ).generate(prompts, 10)
            agreed = sum(
                next(
                    (k for k, (a, b) in enumerate(zip(t, r, strict=False)) if a != b),
                    min(len(t), len(r)),
                )
                for t, r in zip(res.tokens, answers, strict=True)
            )
            same = sum(t == r for t, r in zip(res.tokens, answers, strict=True))
            assert agreed / len(differs) == pytest.approx(tok)
            assert same / len(prompts) == pytest.approx(exact)
            assert 0 < tok < 1  # not vacuous: some answers diverge, some tokens agree
            checked += 1
    assert checked == 4


def test_serve_loads_an_exit_head_small_model_and_a_neural_router(
    early_exit_pair: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`tokencache serve --small exit:PATH --router neural:PATH`: the model and router the
    curve measured, loaded by the server's own functions (the large model stubbed tiny)."""
    pytest.importorskip("starlette")
    from tokencache_models.early_exit import save_exit_head
    from tokencache_serve import loading

    large, small, prompts, trace = early_exit_pair
    head = small.model.norm
    save_exit_head(tmp_path / "head.pt", 1, head)

    class Tok:
        eos_token_id = None

    monkeypatch.setattr(loading, "_load_one", lambda *a, **k: (large, Tok()))
    models = loading.load_models("stub-large", small=f"exit:{tmp_path / 'head.pt'}")
    assert "exit head" in models.description
    assert (
        len(models.small.model.layers) == 1
        and models.small.model.layers[0] is large.model.layers[0]
    )
    rows = small_rows(large, head, trace.layer_hidden[1], trace.tokens)
    router = train(rows.features(), epochs=2, width=32, num_blocks=1)
    router.threshold = 0.5
    router.save(tmp_path / "router.pt")
    loaded = loading.parse_router(f"neural:{tmp_path / 'router.pt'}", models.small)
    want = RoutedEngine(
        small,
        large,
        router.__class__.load(tmp_path / "router.pt", embedding=large.model.embed_tokens.weight),
        config=EngineConfig(num_slots=2048),
    ).generate(prompts[:6], 8)
    got = RoutedEngine(models.small, large, loaded, config=EngineConfig(num_slots=2048)).generate(
        prompts[:6], 8
    )
    assert got.tokens == want.tokens and got.models == want.models
    with pytest.raises(FileNotFoundError):
        loading.load_models("stub-large", small=f"exit:{tmp_path / 'missing.pt'}")


class CharTokenizer:
    """Enough of a tokenizer for labels.label: characters to ids, a trivial chat template."""

    eos_token_id = None

    def apply_chat_template(
        self, messages: Any, tokenize: bool, add_generation_prompt: bool
    ) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) % 96 for c in text[-12:]]  # short prompts: the tail of each question


@pytest.mark.parametrize("head_split", [False, True])
def test_label_keeps_test_prompts_from_head_and_router(head_split: bool, tmp_path: Path) -> None:
    from tokencache_routing.tools.labels import label

    torch.set_num_threads(1)
    large = random_model(tiny_config(15), seed=6, std=0.3, attention_backend="torch")  # traces 14
    lab = label(
        large,
        CharTokenizer(),
        8,
        n_prompts=8,
        max_new=4,
        distill_epochs=1,
        out_dir=tmp_path,
        head_split=head_split,
    )
    assert lab.test_prompts == [6, 7]
    assert not set(lab.test_prompts) & (set(lab.train_prompts) | set(lab.head_prompts))
    if head_split:
        assert not set(lab.train_prompts) & set(lab.head_prompts)
        assert sorted(lab.train_prompts + lab.head_prompts) == list(range(6))
    else:
        assert lab.train_prompts == lab.head_prompts == list(range(6))
    assert len(lab.train.label) == len(lab.trace.rows(lab.train_prompts))
    assert len(lab.test.label) == len(lab.trace.rows(lab.test_prompts))
    assert lab.head_path.exists() and len(list(tmp_path.glob("features-*.pt"))) == 2
    # The labels are the small model's differences from the large model's own tokens.
    test_rows = lab.trace.rows(lab.test_prompts)
    want = (lab.test.small_tokens != lab.trace.tokens[test_rows]).float()
    assert torch.equal(lab.test.label, want)
    # A second call reuses the cache: the same head, the same rows.
    again = label(
        large,
        CharTokenizer(),
        8,
        n_prompts=8,
        max_new=4,
        distill_epochs=1,
        out_dir=tmp_path,
        head_split=head_split,
    )
    assert torch.equal(again.train.hidden, lab.train.hidden)
