"""No-cache reference: every token recomputed from scratch with the model the router chose."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from tokencache_models import CausalLM, ForwardBatch

# decide(request index, generated-token position) -> True when the large model writes the token
Decide = Callable[[int, int], bool]


def full_forward_logits(model: CausalLM, seq: Sequence[int]) -> torch.Tensor:
    """Next-token logits after seq, from a fresh pool with nothing cached."""
    pool = model.make_kv_pool(len(seq))
    batch = ForwardBatch.from_requests([list(seq)], [[]], [torch.arange(len(seq))])
    logits: torch.Tensor = model(batch, pool).logits[0]
    return logits


def reference_generate(
    small: CausalLM,
    large: CausalLM,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    decide: Decide,
    eos_token_id: int | None = None,
) -> tuple[list[list[int]], list[list[int]]]:
    """(tokens, models) per request; models[i][t] = 1 when the large model wrote token t."""
    all_tokens: list[list[int]] = []
    all_models: list[list[int]] = []
    vocab = min(small.config.vocab_size, large.config.vocab_size)  # the ids both models have
    for rid, prompt in enumerate(prompts):
        seq = list(prompt)
        toks: list[int] = []
        models: list[int] = []
        for pos in range(max_new_tokens):
            use_large = bool(decide(rid, pos))
            logits = full_forward_logits(large if use_large else small, seq)[:vocab]
            tok = int(logits.argmax())
            seq.append(tok)
            toks.append(tok)
            models.append(int(use_large))
            if tok == eos_token_id:
                break
        all_tokens.append(toks)
        all_models.append(models)
    return all_tokens, all_models


def decide_from_models(models: Sequence[Sequence[int]]) -> Decide:
    """Replays recorded decisions (for routers that read logits, e.g. entropy thresholds)."""
    return lambda rid, pos: bool(models[rid][pos])
