"""Collect router training features from a small/large pair (label: their greedy tokens differ).

A cheap stand-in for R2R's verifier labels: the large model writes each sequence; at every
position the small model's features are recorded with label 1 where its top-1 token differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokencache_models import CausalLM, ForwardBatch


@torch.no_grad()
def collect_features(
    small: CausalLM,
    large: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    top_k: int = 100,
) -> dict[str, torch.Tensor]:
    rows: dict[str, list[torch.Tensor]] = {k: [] for k in ("hidden", "token_emb", "topk_logits")}
    labels: list[torch.Tensor] = []
    emb = small.model.embed_tokens.weight
    for prompt in prompts:
        seq = list(prompt)
        for _ in range(max_new_tokens):
            outs = []
            for m in (small, large):
                pool = m.make_kv_pool(len(seq))
                fb = ForwardBatch.from_requests([seq], [[]], [torch.arange(len(seq))])
                outs.append(m(fb, pool))
            s, lg = outs
            tok = s.logits.argmax(-1)
            big = int(lg.logits.argmax(-1))
            rows["hidden"].append(s.hidden.float())
            rows["token_emb"].append(emb[tok].float())
            rows["topk_logits"].append(s.logits.topk(min(top_k, s.logits.shape[-1]), -1).values)
            labels.append(torch.tensor([float(int(tok) != big)]))
            seq.append(big)
    out = {k: torch.cat(v) for k, v in rows.items()}
    out["label"] = torch.cat(labels)
    return out
