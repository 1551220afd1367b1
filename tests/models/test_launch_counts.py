"""Kernel launches per decoder layer and per forward, pinned (testing/launch_counter.py counts
them on the CPU: a count, never a time), and the merged projections that make the count.

The fused Triton path runs under TRITON_INTERPRET=1 in a subprocess (the interpreter must be
on before triton is imported); the unfused torch path runs here. A change that adds a launch
to a layer or to a forward fails these; one that removes launches updates the pins (and the
table in integrations/tokencache_models/README.md:
`python -m tokencache_models.testing.launch_counter`).
"""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tokencache_models import ForwardBatch, random_model
from tokencache_models import model as model_module
from tokencache_models.layers import apply_rope
from tokencache_models.testing.launch_counter import (
    PATHS,
    count_launches,
    count_paths,
    launches_kernel,
    small_config,
)

# Per layer, then outside the layers (2-layer model: per forward = outside + 2 * per layer).
# Before the merged GEMMs and the q/k/v kernel the fused path was 15 / 15 / 16 / 17 / 17 per
# layer and 10 outside; the torch path 52 / 52 / 50 (Qwen3), 40 / 40 / 38 (Qwen2, Llama).
FUSED = {
    "prefill": (9, 5),
    "catch-up": (9, 5),
    "decode": (10, 5),
    "catch-up, shared prefix": (11, 5),
    "decode, shared prefix": (11, 5),
}
TORCH = {
    "qwen3": {"multi": (49, 29), "decode": (47, 19)},
    # No q/k norms: 12 ops fewer a layer.
    "qwen2": {"multi": (37, 29), "decode": (35, 19)},
    "llama": {"multi": (37, 29), "decode": (35, 19)},
}
FUSED_KERNELS = {
    "prefill": {
        "triton._add_rmsnorm_kernel": 2,
        "aten.linear": 4,  # qkv, o, gate-up, down
        "triton._qkv_norm_rope_store_kernel": 1,
        "triton._paged_varlen_kernel": 1,
        "triton._silu_mul_kernel": 1,
    },
    "outside": {
        "aten.embedding": 1,
        "aten.index_select": 2,  # the last tokens' rows of the stream and the residual
        "triton._add_rmsnorm_kernel": 1,
        "aten.linear": 1,
    },
}

SCRIPT = r"""
import json, sys
from tokencache_models.kernels import fused
from tokencache_models.testing.launch_counter import count_paths

out = {}
for family in ("qwen3", "qwen2", "llama"):
    counts = count_paths(True, "triton", family)
    out[family] = {p: [c.per_layer, c.outside, c.total] for p, c in counts.items()}
c = count_paths(True, "triton")
out["names"] = {
    "prefill": dict(c["prefill"].by_name(0)), "outside": dict(c["prefill"].by_name(None)),
}

# A planted extra launch: every add_rmsnorm call launching its kernel twice (two a layer, one
# in the final norm).
original = fused.add_rmsnorm
def twice(*args, **kwargs):
    original(*args, **kwargs)
    return original(*args, **kwargs)
fused.add_rmsnorm = twice
c = count_paths(True, "triton")["decode"]
out["planted"] = [c.per_layer, c.outside, c.total]
print(json.dumps(out))
"""


def _interpreted() -> dict[str, object]:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root / "integrations")}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_fused_triton_path_launch_counts_in_interpreter() -> None:
    """Per layer: add_rmsnorm, the q/k/v GEMM, q/k norm + RoPE + the K/V write, attention
    (decode: its kernel and the split-KV merge; rows sharing a prefix: the shared-prefix kernel
    and the merge), o_proj, add_rmsnorm, the gate/up GEMM, silu_mul, down_proj: 9 to 11, the
    same for every family; the counter sees an added launch."""
    got = _interpreted()
    for family in ("qwen3", "qwen2", "llama"):
        rows = got[family]
        assert isinstance(rows, dict) and list(rows) == list(PATHS)
        for path, (per_layer, outside) in FUSED.items():
            assert rows[path] == [[per_layer] * 2, outside, outside + 2 * per_layer], (
                family,
                path,
            )
            assert per_layer <= 12
    assert got["names"] == FUSED_KERNELS
    per_layer, outside = FUSED["decode"]
    assert got["planted"] == [[per_layer + 2] * 2, outside + 1, outside + 1 + 2 * (per_layer + 2)]


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_unfused_torch_path_launch_counts(family: str) -> None:
    counts = count_paths(False, "torch", family)
    assert list(counts) == list(PATHS)
    for path, c in counts.items():
        per_layer, outside = TORCH[family]["decode" if "decode" in path else "multi"]
        assert (c.per_layer, c.outside, c.total) == (
            [per_layer] * 2,
            outside,
            outside + 2 * per_layer,
        ), path
        assert c.kernels_per_layer == per_layer
        # One GEMM for q/k/v and one for gate/up, beside o_proj and down_proj.
        assert c.by_name(0)["aten.linear"] == 4


def test_the_counter_catches_an_added_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """An extra op planted in the layer (RoPE followed by a copy) raises the count by exactly
    what it launches: two a layer (q and k), none outside."""
    base = count_paths(False, "torch")["decode"]

    def rope_and_copy(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin).clone()

    monkeypatch.setattr(model_module, "apply_rope", rope_and_copy)
    planted = count_paths(False, "torch")["decode"]
    assert planted.per_layer == [n + 2 for n in base.per_layer]
    assert planted.outside == base.outside
    assert planted.by_name(0)["aten.clone"] == 2


def test_the_counting_rule() -> None:
    """Views, reshapes and empty allocations launch nothing; a fill, a copy that converts, an
    index_copy_ and an elementwise op launch one each; a .to() that converts nothing, none."""
    x = torch.randn(4, 6)
    with count_launches() as c:
        x.view(2, 12).t().reshape(12, 2)[1:].unsqueeze(0).expand(3, 11, 2).transpose(0, 1)
        x.split(3, dim=1)[0].detach().narrow(0, 1, 2).select(0, 0).chunk(2)
        torch.empty(5)
        torch.empty_like(x)
        x.new_empty((2, 2))
        x.to(torch.float32)
        x.contiguous()
    assert c.result.total == 0, c.result.names
    with count_launches() as c:
        torch.zeros(3)
        x.to(torch.float64)
        x.t().contiguous()
        torch.zeros(5, 6).index_copy_(0, torch.tensor([0, 2]), x[:2])
        x + 1
    assert c.result.names == [
        "aten.zeros",
        "aten._to_copy",
        "aten.clone",
        "aten.zeros",
        "aten.index_copy_",
        "aten.add",
    ], c.result.names
    assert not launches_kernel(torch.ops.aten._unsafe_view.default)
    assert launches_kernel(torch.ops.aten.mm.default)


def test_layers_scope_their_launches_and_are_restored() -> None:
    model = random_model(small_config(), seed=0, attention_backend="torch")
    layers = model.model.layers
    with count_launches(layers):
        assert all("forward" in layer.__dict__ for layer in layers)
    assert not any("forward" in layer.__dict__ for layer in layers)
    assert not any("forward_fused" in layer.__dict__ for layer in layers)


# -- the merged projections ------------------------------------------------------------------


def _logits(model: nn.Module, pool_size: int = 64) -> torch.Tensor:
    pool = model.make_kv_pool(pool_size)  # type: ignore[operator]
    a, b = pool.alloc(5), pool.alloc(3)
    batch = ForwardBatch.from_requests([[1, 2, 3, 4, 5], [6, 7, 8]], [[], []], [a, b])
    out: torch.Tensor = model(batch, pool).logits
    return out


@pytest.mark.parametrize("family", ["qwen3", "qwen2"])
def test_projections_are_views_of_one_buffer_under_their_hf_names(family: str) -> None:
    model = random_model(small_config(family), seed=1, std=0.2, attention_backend="torch")
    sd = model.state_dict()
    assert not any("qkv" in k or "gate_up" in k for k in sd)
    assert "model.layers.1.self_attn.k_proj.weight" in sd
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv, gate_up = attn.qkv.weight, mlp.gate_up.weight
    assert qkv is not None and gate_up is not None
    item = qkv.element_size()
    assert attn.q_proj.weight.data_ptr() == qkv.data_ptr()
    assert attn.k_proj.weight.data_ptr() == qkv.data_ptr() + 4 * 16 * 32 * item
    assert attn.v_proj.weight.data_ptr() == qkv.data_ptr() + 6 * 16 * 32 * item
    assert mlp.up_proj.weight.data_ptr() == gate_up.data_ptr() + 48 * 32 * item
    if family == "qwen2":
        assert attn.qkv.bias is not None
        assert attn.v_proj.bias.data_ptr() == attn.qkv.bias.data_ptr() + 6 * 16 * item
    # Memory is not doubled: the parameters share the merged buffers' storage.
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert qkv.untyped_storage().data_ptr() in params


def test_writes_replacements_and_moves_reach_the_merged_gemm() -> None:
    """load_state_dict after a forward writes into the merged buffers; a replaced Linear (as
    sharding does) and Module.to() are noticed and merged again; a pickled model merges on
    arrival. Each compared with a model loaded fresh from the same weights."""
    model = random_model(small_config("qwen2"), seed=2, std=0.2, attention_backend="torch")
    other = random_model(small_config("qwen2"), seed=3, std=0.2, attention_backend="torch")
    _logits(model)
    model.load_state_dict(other.state_dict())
    assert torch.equal(_logits(model), _logits(other))

    attn = model.model.layers[1].self_attn
    k = nn.Linear(32, 32, bias=True)
    with torch.no_grad():
        k.weight.copy_(attn.k_proj.weight * 2)
        k.bias.copy_(attn.k_proj.bias)
    attn.k_proj = k
    with torch.no_grad():
        other.model.layers[1].self_attn.k_proj.weight.mul_(2)
    assert torch.equal(_logits(model), _logits(other))
    assert attn.qkv.weight is not None
    assert attn.k_proj.weight.data_ptr() == attn.qkv.weight.data_ptr() + 64 * 32 * 4

    model.to(torch.float64)
    other.to(torch.float64)
    assert torch.equal(_logits(model), _logits(other))
    assert attn.qkv.weight.dtype == torch.float64
    assert attn.q_proj.weight.data_ptr() == attn.qkv.weight.data_ptr()

    clone = pickle.loads(pickle.dumps(model))
    assert torch.equal(_logits(clone), _logits(other))
    assert clone.model.layers[0].self_attn.qkv.weight is not None


def test_merged_gemm_is_used_by_both_paths() -> None:
    """The unfused path reads the merged buffer too: a weight written through the buffer
    moves its logits."""
    model = random_model(small_config(), seed=4, std=0.2, attention_backend="torch")
    model.fused = False
    before = _logits(model)
    gate_up = model.model.layers[0].mlp.gate_up.weight
    assert gate_up is not None
    with torch.no_grad():
        gate_up[48:].zero_()  # up_proj's rows
    assert not model.model.layers[0].mlp.up_proj.weight.any()
    assert not torch.allclose(_logits(model), before)
