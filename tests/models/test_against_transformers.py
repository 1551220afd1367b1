"""Our paged runner vs transformers on tiny random Qwen3 / Llama checkpoints (fp32, CPU)."""

from __future__ import annotations

from typing import Any

import torch

from tokencache_models import (
    CausalLM,
    ForwardBatch,
    GreedyRunner,
    load_hf_checkpoint,
    truncate_model,
)

ATOL = 1e-4  # fp32; observed differences are ~1e-6


@torch.no_grad()
def hf_last(hf: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' next-token logits and final-norm hidden state after the last of `ids`."""
    x = torch.tensor([ids])
    out = hf.model(x)
    hidden = out.last_hidden_state[0, -1]
    return hf.lm_head(hidden), hidden


@torch.no_grad()
def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by transformers' generate (KV cache on, no EOS configured)."""
    out = hf.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return out[0, len(ids) :].tolist()


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _load(ckpt: Any) -> CausalLM:
    model = load_hf_checkpoint(ckpt.path, attention_backend="torch")
    assert model.dtype == torch.float32
    return model


def test_config_roundtrip(tiny_ckpt: Any) -> None:
    model = _load(tiny_ckpt)
    assert model.config.qk_norm == (tiny_ckpt.arch == "qwen3")
    assert model.config.tie_word_embeddings == (tiny_ckpt.arch == "qwen3")
    if tiny_ckpt.arch == "llama":
        assert model.config.rope_scaling and model.config.rope_scaling["rope_type"] == "llama3"
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_batch_of_different_prompt_lengths(tiny_ckpt: Any) -> None:
    model = _load(tiny_ckpt)
    pool = model.make_kv_pool(512)
    prompts = _prompts(model.config.vocab_size, [1, 6, 17, 40, 3], seed=1)
    slots = [pool.alloc(len(p)) for p in prompts]
    batch = ForwardBatch.from_requests(prompts, [[]] * len(prompts), slots)
    out = model(batch, pool)
    assert out.logits.shape == (len(prompts), model.config.vocab_size)
    assert out.hidden.shape == (len(prompts), model.config.hidden_size)
    for i, p in enumerate(prompts):
        ref_logits, ref_hidden = hf_last(tiny_ckpt.hf_model, p)
        torch.testing.assert_close(out.logits[i], ref_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[i], ref_hidden, atol=ATOL, rtol=0)
        assert int(out.logits[i].argmax()) == int(ref_logits.argmax())


def test_shared_prefix_written_once_read_by_both(tiny_ckpt: Any) -> None:
    model = _load(tiny_ckpt)
    pool = model.make_kv_pool(256)
    prefix, tail_a, tail_b = _prompts(model.config.vocab_size, [20, 5, 9], seed=2)
    prefix_slots = pool.alloc(len(prefix))
    model(ForwardBatch.from_requests([prefix], [[]], [prefix_slots]), pool)
    k_before, v_before = pool.k[:, prefix_slots].clone(), pool.v[:, prefix_slots].clone()
    used_before = pool.allocator.used

    slots_a, slots_b = pool.alloc(len(tail_a)), pool.alloc(len(tail_b))
    batch = ForwardBatch.from_requests(
        [tail_a, tail_b], [prefix_slots, prefix_slots], [slots_a, slots_b]
    )
    # Only the tails' tokens are computed; both requests read the same prefix slots.
    assert batch.num_tokens == len(tail_a) + len(tail_b)
    assert not set(batch.out_slots.tolist()) & set(prefix_slots.tolist())
    out = model(batch, pool)
    assert torch.equal(pool.k[:, prefix_slots], k_before)
    assert torch.equal(pool.v[:, prefix_slots], v_before)
    assert pool.allocator.used == used_before + len(tail_a) + len(tail_b)
    for i, tail in enumerate([tail_a, tail_b]):
        ref_logits, ref_hidden = hf_last(tiny_ckpt.hf_model, prefix + tail)
        torch.testing.assert_close(out.logits[i], ref_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[i], ref_hidden, atol=ATOL, rtol=0)


def test_prefix_and_sharer_in_one_forward(tiny_ckpt: Any) -> None:
    # K/V of a layer are written before that layer attends, so a request may read slots that
    # another request of the same batch is filling.
    model = _load(tiny_ckpt)
    pool = model.make_kv_pool(256)
    prefix, tail = _prompts(model.config.vocab_size, [12, 4], seed=3)
    prefix_slots, tail_slots = pool.alloc(len(prefix)), pool.alloc(len(tail))
    batch = ForwardBatch.from_requests(
        [prefix, tail], [[], prefix_slots], [prefix_slots, tail_slots]
    )
    out = model(batch, pool)
    for i, ids in enumerate([prefix, prefix + tail]):
        ref_logits, _ = hf_last(tiny_ckpt.hf_model, ids)
        torch.testing.assert_close(out.logits[i], ref_logits, atol=ATOL, rtol=0)


def test_extend_existing_cache(tiny_ckpt: Any) -> None:
    model = _load(tiny_ckpt)
    pool = model.make_kv_pool(256)
    prompt, ext1, ext2 = _prompts(model.config.vocab_size, [15, 7, 1], seed=4)
    slots = pool.alloc(len(prompt))
    model(ForwardBatch.from_requests([prompt], [[]], [slots]), pool)
    ids = list(prompt)
    for ext in (ext1, ext2):  # an extend of k tokens, then of a single token
        new = pool.alloc(len(ext))
        out = model(ForwardBatch.from_requests([ext], [slots], [new]), pool)
        slots, ids = torch.cat((slots, new)), ids + ext
        ref_logits, ref_hidden = hf_last(tiny_ckpt.hf_model, ids)
        torch.testing.assert_close(out.logits[0], ref_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[0], ref_hidden, atol=ATOL, rtol=0)


def test_multistep_greedy_decode_batch(tiny_ckpt: Any) -> None:
    model = _load(tiny_ckpt)
    pool = model.make_kv_pool(512)
    runner = GreedyRunner(model, pool)
    prompts = _prompts(model.config.vocab_size, [3, 11, 26], seed=5)
    rids = [runner.add_request(p) for p in prompts]
    n = 12
    got = runner.generate(rids, n)  # step 1 is a ragged prefill, then batched decode steps
    for p, g in zip(prompts, got, strict=True):
        assert g == hf_greedy(tiny_ckpt.hf_model, p, n)
    used = pool.allocator.used
    assert used == sum(len(p) + n - 1 for p in prompts)  # the last token is pending, not cached
    for r in rids:
        runner.release(r)
    assert pool.allocator.used == 0


def test_runner_shared_prefix_requests_decode_like_transformers(tiny_ckpt: Any) -> None:
    model = _load(tiny_ckpt)
    pool = model.make_kv_pool(512)
    runner = GreedyRunner(model, pool)
    prefix, a, b = _prompts(model.config.vocab_size, [16, 3, 5], seed=6)
    root = runner.add_request(prefix)
    runner.step([root])
    ra = runner.add_request(prefix + a, share_from=root, shared_len=len(prefix))
    rb = runner.add_request(prefix + b, share_from=root, shared_len=len(prefix))
    got = runner.generate([ra, rb], 6)
    assert got[0] == hf_greedy(tiny_ckpt.hf_model, prefix + a, 6)
    assert got[1] == hf_greedy(tiny_ckpt.hf_model, prefix + b, 6)
    runner.release(root)  # shared slots stay alive for ra and rb
    # Prefix once, each tail, and 5 decoded tokens each (the 6th is pending, not cached).
    assert pool.allocator.used == len(prefix) + len(a) + len(b) + 2 * 5
    runner.release(ra)
    runner.release(rb)
    assert pool.allocator.used == 0


def test_truncated_model_matches_transformers_with_fewer_layers(tiny_ckpt: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = _load(tiny_ckpt)
    small = truncate_model(model, 2)
    assert small.config.num_hidden_layers == 2
    assert (
        small.model.layers[0].self_attn.q_proj.weight
        is model.model.layers[0].self_attn.q_proj.weight
    )
    hf_small = AutoModelForCausalLM.from_pretrained(
        tiny_ckpt.path, dtype=torch.float32, num_hidden_layers=2
    ).eval()
    pool = small.make_kv_pool(64)
    (prompt,) = _prompts(model.config.vocab_size, [10], seed=7)
    out = small(ForwardBatch.from_requests([prompt], [[]], [pool.alloc(len(prompt))]), pool)
    ref_logits, _ = hf_last(hf_small, prompt)
    torch.testing.assert_close(out.logits[0], ref_logits, atol=ATOL, rtol=0)
