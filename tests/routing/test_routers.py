"""Routers: threshold semantics, determinism, the neural router's file round trip and training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from routing_helpers import ROOT, make_prompts

from tokencache_routing import (
    BernoulliRouter,
    EngineConfig,
    EntropyRouter,
    NeuralRouter,
    RoutedEngine,
    RouterFeatures,
    ScriptedRouter,
    Top1ProbRouter,
    reference_generate,
)
from tokencache_routing.baselines.reference import decide_from_models
from tokencache_routing.core.features import collect_features


def feats(logits: torch.Tensor, hidden_size: int = 4) -> RouterFeatures:
    b = logits.shape[0]
    return RouterFeatures(
        logits=logits,
        hidden=torch.zeros(b, hidden_size),
        tokens=logits.argmax(-1),
        positions=torch.arange(b),
        rids=torch.zeros(b, dtype=torch.int64),
    )


def test_entropy_and_top1_thresholds() -> None:
    peaked = torch.tensor([10.0, 0.0, 0.0, 0.0])
    flat = torch.zeros(4)
    f = feats(torch.stack([peaked, flat]))
    assert torch.allclose(f.entropy[1], torch.tensor(np.log(4.0), dtype=torch.float32))
    assert EntropyRouter(0.45).route(f).tolist() == [False, True]
    assert Top1ProbRouter(0.5).route(f).tolist() == [False, True]


def test_bernoulli_is_a_function_of_request_and_position() -> None:
    r = BernoulliRouter(0.2, seed=3)
    rids = np.repeat(np.arange(50), 200)
    pos = np.tile(np.arange(200), 50)
    a = r.decide(rids, pos)
    assert np.array_equal(a, r.decide(rids, pos))
    assert abs(a.mean() - 0.2) < 0.02
    assert not np.array_equal(a, BernoulliRouter(0.2, seed=4).decide(rids, pos))
    # Batch order and composition do not matter.
    perm = np.random.default_rng(0).permutation(len(rids))
    assert np.array_equal(r.decide(rids[perm], pos[perm]), a[perm])


def test_scripted_router() -> None:
    r = ScriptedRouter({1: [0, 2]}, default=[5])
    assert [r.decide(1, p) for p in range(6)] == [True, False, True, False, False, False]
    assert r.decide(0, 5) and not r.decide(0, 0)
    assert ScriptedRouter(every=True).decide(3, 7)


def test_neural_router_save_load_and_route(tmp_path: Path) -> None:
    torch.manual_seed(0)
    emb = torch.randn(96, 8)
    r = NeuralRouter(hidden_size=4, embed_dim=8, top_k=100, width=32, num_blocks=2, embedding=emb)
    path = tmp_path / "router.pt"
    r.save(path)
    r2 = NeuralRouter.load(path, embedding=emb)
    f = feats(torch.randn(5, 96))
    f.hidden = torch.randn(5, 4)
    with torch.no_grad():
        s1 = r(f.hidden, emb[f.tokens], f.topk_logits(100))
        s2 = r2(f.hidden, emb[f.tokens], f.topk_logits(100))
    assert torch.equal(s1, s2)
    out = r2.route(f)
    assert out.dtype == torch.bool and out.shape == (5,)


def test_train_router_cli_and_routed_generation(pair: Any, tmp_path: Path) -> None:
    from tokencache_models import truncate_model

    large = pair[1]
    small = truncate_model(large, 1)  # a pair that agrees on some tokens, not all
    feats_d = collect_features(small, large, make_prompts(6, seed=20), 8, top_k=16)
    assert 0 < float(feats_d["label"].sum()) < len(feats_d["label"])
    fpath = tmp_path / "feats.pt"
    torch.save(feats_d, fpath)
    npz = tmp_path / "feats.npz"
    np.savez(npz, **{k: v.numpy() for k, v in feats_d.items()})
    out = tmp_path / "router.pt"
    cmd = [
        sys.executable,
        "-m",
        "tokencache_routing",
        "train-router",
        "--features",
        str(fpath),
        str(npz),
        "--out",
        str(out),
        "--top-k",
        "16",
        "--width",
        "32",
        "--epochs",
        "5",
    ]
    env = {"PYTHONPATH": str(ROOT / "integrations"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "threshold" in proc.stdout
    router = NeuralRouter.load(out, embedding=small.model.embed_tokens.weight)
    prompts = make_prompts(3, seed=21)
    res = RoutedEngine(small, large, router, config=EngineConfig(num_slots=256)).generate(
        prompts, 8
    )
    ref, _ = reference_generate(small, large, prompts, 8, decide_from_models(res.models))
    assert res.tokens == ref


def test_neural_router_needs_embedding() -> None:
    r = NeuralRouter(hidden_size=4, embed_dim=8, top_k=4, width=8, num_blocks=1)
    with pytest.raises(ValueError):
        r.route(feats(torch.randn(2, 6)))
