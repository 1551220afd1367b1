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
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def tiny_config(layers: int, vocab: int = TINY_VOCAB, hidden: int = 32) -> ModelConfig:
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
        max_position_embeddings=512,
    )


def tiny_pair(
    small_layers: int = 1, large_layers: int = 2, hidden: int = 32
) -> tuple[CausalLM, CausalLM]:
    small = random_model(
        tiny_config(small_layers, hidden=hidden), seed=1, std=0.3, attention_backend="torch"
    )
    large = random_model(
        tiny_config(large_layers, hidden=hidden), seed=2, std=0.3, attention_backend="torch"
    )
    return small.eval(), large.eval()


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
