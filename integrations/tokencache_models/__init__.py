"""Paged-KV model runner for Qwen3 and Llama (SmolLM2) in torch.

One forward call runs a ragged batch of prefill/extend/decode requests whose K/V live in a
per-model slot pool; prefix slots may be shared between requests (read, never recomputed).
"""

from .attention import TorchPagedAttention, TritonPagedAttention, make_attention_backend
from .batch import ForwardBatch
from .config import (
    PRESETS,
    QWEN3_0_6B,
    QWEN3_8B,
    QWEN3_32B,
    R1_DISTILL_QWEN_1_5B,
    R1_DISTILL_QWEN_32B,
    ModelConfig,
    UnsupportedConfigError,
)
from .context import DeferredTokens, ForwardContext, ForwardOutput, HostBatch, shared_prefix_len
from .epilogue import Epilogue
from .executor import ModelExecutor, PreparedStep
from .graphs import DecodeGraphRunner
from .kv_pool import KVPool, SlotAllocator
from .loader import (
    GGUFModel,
    empty_model,
    find_smollm2_gguf,
    from_transformers,
    load_gguf,
    load_hf_checkpoint,
    load_smollm2_gguf,
    model_from_state_dict,
    random_model,
    truncate_model,
)
from .model import CausalLM
from .prefix_groups import (
    MAX_PREFIX_GROUPS,
    PrefixGroup,
    find_prefix_groups,
    paying_groups,
    prefix_traffic,
)
from .prefix_plan import MIN_SHARED_PREFIX, PrefixShape
from .runner import GreedyRunner
from .slot_table import SlotTable

__all__ = [
    "MAX_PREFIX_GROUPS",
    "MIN_SHARED_PREFIX",
    "PRESETS",
    "QWEN3_0_6B",
    "QWEN3_8B",
    "QWEN3_32B",
    "R1_DISTILL_QWEN_1_5B",
    "R1_DISTILL_QWEN_32B",
    "CausalLM",
    "DecodeGraphRunner",
    "DeferredTokens",
    "Epilogue",
    "ForwardBatch",
    "ForwardContext",
    "ForwardOutput",
    "GGUFModel",
    "GreedyRunner",
    "HostBatch",
    "KVPool",
    "ModelConfig",
    "ModelExecutor",
    "PrefixGroup",
    "PrefixShape",
    "PreparedStep",
    "SlotAllocator",
    "SlotTable",
    "TorchPagedAttention",
    "TritonPagedAttention",
    "UnsupportedConfigError",
    "empty_model",
    "find_prefix_groups",
    "find_smollm2_gguf",
    "from_transformers",
    "load_gguf",
    "load_hf_checkpoint",
    "load_smollm2_gguf",
    "make_attention_backend",
    "model_from_state_dict",
    "paying_groups",
    "prefix_traffic",
    "random_model",
    "shared_prefix_len",
    "truncate_model",
]
