"""Tiny random models and an in-process word-level tokenizer, for tests and the quick benchmark.

Nothing is downloaded: the tokenizer is built with `tokenizers` (one token per word "t0".."tN",
special tokens for the chat roles and <eos>) and wrapped in PreTrainedTokenizerFast with a
small chat template.
"""

from __future__ import annotations

from typing import Any

from tokencache_models import CausalLM, ModelConfig, random_model

TINY_VOCAB = 96
SPECIALS = ("<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>")
# EntropyRouter threshold at which tiny_pair's small model escalates roughly 40% of its tokens.
TINY_ENTROPY_THRESHOLD = 3.4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_config(
    layers: int, vocab: int = TINY_VOCAB, hidden: int = 32, max_position: int = 512
) -> ModelConfig:
    # Untied head and a wide init (std 0.3 below): varied greedy outputs, clear argmax margins.
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        max_position_embeddings=max_position,
    )


def tiny_pair(
    small_layers: int = 1, large_layers: int = 2, hidden: int = 32, max_position: int = 512
) -> tuple[CausalLM, CausalLM]:
    """Random weights (seeds 1 and 2), one vocabulary; the torch attention backend (CPU)."""
    models = []
    for seed, layers in ((1, small_layers), (2, large_layers)):
        cfg = tiny_config(layers, hidden=hidden, max_position=max_position)
        models.append(random_model(cfg, seed=seed, std=0.3, attention_backend="torch").eval())
    return models[0], models[1]


def tiny_tokenizer(vocab: int = TINY_VOCAB) -> Any:
    """Word-level tokenizer over `vocab` ids: the specials, then words t0, t1, ..."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = [f"t{i}" for i in range(vocab - len(SPECIALS))]
    table = {w: i for i, w in enumerate((*SPECIALS, *words))}
    core = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        unk_token="<unk>",
        eos_token="<eos>",
        additional_special_tokens=list(SPECIALS[2:]),
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def words(ids: list[int]) -> str:
    """Text that the tiny tokenizer encodes to exactly `ids` (ordinary words only)."""
    return " ".join(f"t{i - len(SPECIALS)}" for i in ids)
