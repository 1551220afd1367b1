"""Paged-KV model runner for Qwen3 and Llama (SmolLM2) in torch.

One forward call runs a ragged batch of prefill/extend/decode requests whose K/V live in a
per-model slot pool; prefix slots may be shared between requests (read, never recomputed).
"""

from .attention import TorchPagedAttention, TritonPagedAttention, make_attention_backend
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
from .executor.decode_graphs import DecodeGraphRunner
from .executor.model_executor import ModelExecutor, PreparedStep
from .forward.context import (
    DeferredTokens,
    ForwardContext,
    ForwardOutput,
    HostBatch,
    shared_prefix_len,
)
from .forward.epilogue import Epilogue
from .forward.forward_batch import ForwardBatch
from .kv.pool import KVPool, SlotAllocator
from .kv.slot_table import SlotTable
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
from .shared_prefix.groups import (
    MAX_PREFIX_GROUPS,
    PrefixGroup,
    find_prefix_groups,
    paying_groups,
    prefix_traffic,
)
from .shared_prefix.shape import MIN_SHARED_PREFIX, PrefixShape
from .testing.greedy_generation import GreedyRunner

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
