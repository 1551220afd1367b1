"""Qwen2 family (Qwen2, Qwen2.5, DeepSeek-R1-Distill-Qwen) against transformers' own Qwen2.

Tiny random checkpoints of three shapes (tied / untied head, GQA group 2, 3 and MQA, default and
linear RoPE), saved as safetensors and loaded back by both sides; fp32, CPU. Their q/k/v biases
are drawn at random (transformers initialises biases to zero, which would hide a dropped bias).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from tokencache_models import (
    PRESETS,
    CausalLM,
    ForwardBatch,
    GreedyRunner,
    ModelConfig,
    from_transformers,
    load_hf_checkpoint,
    random_model,
    truncate_model,
)
from tokencache_models.config import (
    R1_DISTILL_QWEN_1_5B,
    R1_DISTILL_QWEN_32B,
    UnsupportedConfigError,
)

ATOL = 1e-4  # fp32; observed differences are ~1e-6
ROOT = Path(__file__).resolve().parents[2]

# Shapes: (tied head, GQA 2, default RoPE), (untied, GQA 3, linear scaling), (untied, MQA, one
# layer deeper, a Qwen2.5-like theta).
SHAPES: dict[str, dict[str, Any]] = {
    "tied-gqa2": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 3,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    },
    "untied-gqa3-linear": {
        "hidden_size": 96,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    },
    "untied-mqa": {
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "num_hidden_layers": 4,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


@dataclass
class Qwen2Checkpoint:
    shape: str
    path: Path
    hf_model: Any  # transformers Qwen2ForCausalLM loaded back from `path`, fp32, eval


def _hf_config(shape: str) -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=320,
        intermediate_size=160,
        max_position_embeddings=512,
        initializer_range=0.08,  # wider than the default: clear greedy margins
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
        # R1-Distill-Qwen's configs carry a window that use_sliding_window leaves off.
        use_sliding_window=False,
        sliding_window=4096,
        max_window_layers=1,
        **SHAPES[shape],
    )


@pytest.fixture(scope="module", params=sorted(SHAPES))
def qwen2_ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM

    shape: str = request.param
    torch.manual_seed(2026)
    model = AutoModelForCausalLM.from_config(_hf_config(shape), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):  # zero after transformers' init: make them count
                p.normal_(0.0, 0.5)
    path = tmp_path_factory.mktemp(f"tiny-qwen2-{shape}")
    model.save_pretrained(path)
    assert list(path.glob("*.safetensors"))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    return Qwen2Checkpoint(shape=shape, path=path, hf_model=hf)


@torch.no_grad()
def hf_last(hf: Any, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' next-token logits and final-norm hidden state after the last of `ids`."""
    out = hf.model(torch.tensor([ids]))
    hidden = out.last_hidden_state[0, -1]
    return hf.lm_head(hidden), hidden


@torch.no_grad()
def hf_greedy(hf: Any, ids: list[int], n: int) -> list[int]:
    """Greedy continuation by transformers' generate (its KV cache on, no EOS)."""
    out = hf.generate(
        torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    return list(out[0, len(ids) :].tolist())


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def _load(ckpt: Qwen2Checkpoint) -> CausalLM:
    model = load_hf_checkpoint(ckpt.path, attention_backend="torch")
    assert model.dtype == torch.float32
    return model


def test_checkpoint_loads_with_qkv_biases_and_no_qk_norm(qwen2_ckpt: Qwen2Checkpoint) -> None:
    model = _load(qwen2_ckpt)
    cfg = model.config
    shape = SHAPES[qwen2_ckpt.shape]
    assert cfg.model_type == "qwen2" and cfg.qkv_bias and not cfg.qk_norm
    assert cfg.tie_word_embeddings == shape["tie_word_embeddings"]
    assert cfg.num_key_value_heads == shape["num_key_value_heads"]
    if shape["rope_parameters"]["rope_type"] == "linear":
        assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 4.0
    else:
        assert cfg.rope_scaling is None
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    attn = model.model.layers[0].self_attn
    assert attn.o_proj.bias is None and not hasattr(attn, "q_norm")
    hf_attn = qwen2_ckpt.hf_model.model.layers[0].self_attn
    for proj in ("q_proj", "k_proj", "v_proj"):
        ours, ref = getattr(attn, proj).bias, getattr(hf_attn, proj).bias
        assert ours is not None and torch.equal(ours, ref) and ref.abs().max() > 0.1
    # Every tensor of the checkpoint landed somewhere: the same names and values as transformers.
    ref_sd = qwen2_ckpt.hf_model.state_dict()
    for name, p in model.state_dict().items():
        assert torch.equal(p, ref_sd[name]), name


def test_batch_of_different_prompt_lengths(qwen2_ckpt: Qwen2Checkpoint) -> None:
    model = _load(qwen2_ckpt)
    pool = model.make_kv_pool(512)
    prompts = _prompts(model.config.vocab_size, [1, 6, 17, 40, 3], seed=1)
    slots = [pool.alloc(len(p)) for p in prompts]
    out = model(ForwardBatch.from_requests(prompts, [[]] * len(prompts), slots), pool)
    for i, p in enumerate(prompts):
        ref_logits, ref_hidden = hf_last(qwen2_ckpt.hf_model, p)
        torch.testing.assert_close(out.logits[i], ref_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[i], ref_hidden, atol=ATOL, rtol=0)
        assert int(out.logits[i].argmax()) == int(ref_logits.argmax())


def test_shared_prefix_and_extends_read_the_paged_cache(qwen2_ckpt: Qwen2Checkpoint) -> None:
    model = _load(qwen2_ckpt)
    pool = model.make_kv_pool(256)
    prefix, tail_a, tail_b, ext = _prompts(model.config.vocab_size, [20, 5, 9, 3], seed=2)
    # Scattered slots: the prefix's K/V is found by slot, not by position in the pool.
    pool.alloc(7)
    prefix_slots = pool.alloc(len(prefix)).flip(0)
    model(ForwardBatch.from_requests([prefix], [[]], [prefix_slots]), pool)
    slots_a, slots_b = pool.alloc(len(tail_a)), pool.alloc(len(tail_b))
    out = model(
        ForwardBatch.from_requests(
            [tail_a, tail_b], [prefix_slots, prefix_slots], [slots_a, slots_b]
        ),
        pool,
    )
    for i, tail in enumerate([tail_a, tail_b]):
        ref_logits, ref_hidden = hf_last(qwen2_ckpt.hf_model, prefix + tail)
        torch.testing.assert_close(out.logits[i], ref_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.hidden[i], ref_hidden, atol=ATOL, rtol=0)
    # An extend of several tokens on top of request A (a catch-up).
    a_all = torch.cat((prefix_slots, slots_a))
    out = model(ForwardBatch.from_requests([ext], [a_all], [pool.alloc(len(ext))]), pool)
    ref_logits, _ = hf_last(qwen2_ckpt.hf_model, prefix + tail_a + ext)
    torch.testing.assert_close(out.logits[0], ref_logits, atol=ATOL, rtol=0)


def test_greedy_decode_batch_token_for_token(qwen2_ckpt: Qwen2Checkpoint) -> None:
    model = _load(qwen2_ckpt)
    pool = model.make_kv_pool(512)
    runner = GreedyRunner(model, pool)
    prompts = _prompts(model.config.vocab_size, [3, 11, 26], seed=5)
    rids = [runner.add_request(p) for p in prompts]
    n = 16
    got = runner.generate(rids, n)  # a ragged prefill, then paged decode steps
    for p, g in zip(prompts, got, strict=True):
        assert g == hf_greedy(qwen2_ckpt.hf_model, p, n)
    for r in rids:
        runner.release(r)
    assert pool.allocator.used == 0


def test_shared_prefix_requests_decode_like_transformers(qwen2_ckpt: Qwen2Checkpoint) -> None:
    model = _load(qwen2_ckpt)
    runner = GreedyRunner(model, model.make_kv_pool(512))
    prefix, a, b = _prompts(model.config.vocab_size, [16, 3, 5], seed=6)
    root = runner.add_request(prefix)
    runner.step([root])
    ra = runner.add_request(prefix + a, share_from=root, shared_len=len(prefix))
    rb = runner.add_request(prefix + b, share_from=root, shared_len=len(prefix))
    got = runner.generate([ra, rb], 8)
    assert got[0] == hf_greedy(qwen2_ckpt.hf_model, prefix + a, 8)
    assert got[1] == hf_greedy(qwen2_ckpt.hf_model, prefix + b, 8)


def test_from_transformers_and_truncation(qwen2_ckpt: Qwen2Checkpoint) -> None:
    from transformers import AutoModelForCausalLM

    copied = from_transformers(qwen2_ckpt.hf_model, attention_backend="torch")
    loaded = _load(qwen2_ckpt)
    assert copied.config == loaded.config
    small = truncate_model(loaded, 1)
    hf_small = AutoModelForCausalLM.from_pretrained(
        qwen2_ckpt.path, dtype=torch.float32, num_hidden_layers=1
    ).eval()
    (prompt,) = _prompts(loaded.config.vocab_size, [10], seed=7)
    for model, hf in ((copied, qwen2_ckpt.hf_model), (small, hf_small)):
        pool = model.make_kv_pool(64)
        out = model(ForwardBatch.from_requests([prompt], [[]], [pool.alloc(len(prompt))]), pool)
        ref_logits, _ = hf_last(hf, prompt)
        torch.testing.assert_close(out.logits[0], ref_logits, atol=ATOL, rtol=0)


def test_state_dict_keys_as_hf_names_them(qwen2_ckpt: Qwen2Checkpoint) -> None:
    """A Qwen2 state dict without its biases is refused, never loaded as zeros; the inv_freq
    buffers that old conversions carry are ignored."""
    from tokencache_models import model_from_state_dict

    config = ModelConfig.from_pretrained_dir(qwen2_ckpt.path)
    sd = dict(qwen2_ckpt.hf_model.state_dict())
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    model = model_from_state_dict(config, sd)
    assert torch.equal(
        model.model.layers[-1].self_attn.v_proj.bias,
        sd[f"model.layers.{config.num_hidden_layers - 1}.self_attn.v_proj.bias"],
    )
    del sd["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        model_from_state_dict(config, sd)


@pytest.mark.parametrize("proj", ["q_proj", "k_proj", "v_proj"])
def test_each_dropped_bias_is_caught(qwen2_ckpt: Qwen2Checkpoint, proj: str) -> None:
    """The logit checks above fail if any one of the three biases is ignored: the logits move
    far past ATOL (greedy tokens alone might not notice a dropped q bias)."""
    if qwen2_ckpt.shape != "tied-gqa2":
        pytest.skip("one shape is enough")
    model = _load(qwen2_ckpt)
    # A planted bug: the projection's bias ignored (zeroed in place, so in the merged q/k/v
    # buffer the forward's one GEMM reads).
    with torch.no_grad():
        for layer in model.model.layers:
            getattr(layer.self_attn, proj).bias.zero_()
    prompts = _prompts(model.config.vocab_size, [6, 17, 40], seed=1)
    pool = model.make_kv_pool(512)
    slots = [pool.alloc(len(p)) for p in prompts]
    out = model(ForwardBatch.from_requests(prompts, [[]] * len(prompts), slots), pool)
    err = max(
        float((out.logits[i] - hf_last(qwen2_ckpt.hf_model, p)[0]).abs().max())
        for i, p in enumerate(prompts)
    )
    assert err > 100 * ATOL, err


# ---- configs: the published ones parse to the presets; what is not implemented is refused ----

R1_DISTILL_QWEN_1_5B_JSON: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 1536,
    "initializer_range": 0.02,
    "intermediate_size": 8960,
    "max_position_embeddings": 131072,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 12,
    "num_hidden_layers": 28,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "sliding_window": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.44.0",
    "use_cache": True,
    "use_mrope": False,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
R1_DISTILL_QWEN_32B_JSON: dict[str, Any] = {
    **R1_DISTILL_QWEN_1_5B_JSON,
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "max_window_layers": 64,
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1000000.0,
    "sliding_window": 131072,
    "vocab_size": 152064,
}


@pytest.mark.parametrize(
    "name,published,preset,params",
    [
        ("r1-distill-qwen-1.5b", R1_DISTILL_QWEN_1_5B_JSON, R1_DISTILL_QWEN_1_5B, 1_777_088_000),
        ("r1-distill-qwen-32b", R1_DISTILL_QWEN_32B_JSON, R1_DISTILL_QWEN_32B, 32_763_876_352),
    ],
)
def test_r1_distill_presets_are_the_published_configs(
    name: str, published: dict[str, Any], preset: ModelConfig, params: int
) -> None:
    """The config.json parses to the preset; built on meta, the parameter count is the
    published one (biases included, untied head)."""
    assert PRESETS[name] is preset
    assert ModelConfig.from_hf_dict(published) == preset
    # The same through transformers' own config class (as from_transformers reads it).
    from transformers import Qwen2Config

    assert ModelConfig.from_hf_dict(Qwen2Config(**published).to_dict()) == preset
    with torch.device("meta"):
        model = CausalLM(preset, "torch")
    model.tie_weights()
    assert sum(p.numel() for p in model.parameters()) == params
    assert preset.head_dim == 128 and preset.qkv_bias and not preset.qk_norm


def test_random_model_at_a_qwen2_shape_has_random_biases() -> None:
    cfg = ModelConfig("qwen2", 64, 32, 48, 1, 4, 2, head_dim=8)
    model = random_model(cfg, seed=0, std=0.2, attention_backend="torch")
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.q_proj.bias.std() > 0.1
    assert attn.o_proj.bias is None


def _refused(d: dict[str, Any]) -> UnsupportedConfigError:
    with pytest.raises(UnsupportedConfigError) as e:
        ModelConfig.from_hf_dict(d)
    assert isinstance(e.value, ValueError)  # callers catching ValueError still do
    return e.value


def test_sliding_window_is_refused_when_enabled() -> None:
    from transformers import Qwen2Config

    on = {**R1_DISTILL_QWEN_1_5B_JSON, "use_sliding_window": True}
    err = _refused(on)
    assert err.field == "use_sliding_window" and "use_sliding_window" in str(err)
    # transformers' own dict of the same config (layer_types spelled out) is refused too ...
    assert _refused(Qwen2Config(**on).to_dict()).field == "use_sliding_window"
    # ... and so is a layer list naming a sliding layer without the flag.
    layers = ["full_attention"] * 27 + ["sliding_attention"]
    err = _refused({**R1_DISTILL_QWEN_1_5B_JSON, "layer_types": layers})
    assert err.field == "layer_types" and err.value == ["sliding_attention"]
    # A window that use_sliding_window leaves off is fine (every R1-Distill-Qwen config).
    assert ModelConfig.from_hf_dict(Qwen2Config(**R1_DISTILL_QWEN_1_5B_JSON).to_dict()).qkv_bias


@pytest.mark.parametrize(
    "change,field",
    [
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"model_type": "qwen2_moe"}, "model_type"),
    ],
)
def test_unsupported_qwen2_fields_are_refused_by_name(change: dict[str, Any], field: str) -> None:
    err = _refused({**R1_DISTILL_QWEN_1_5B_JSON, **change})
    assert err.field == field and field in str(err)


def test_attention_bias_refused_where_it_would_bias_o_proj() -> None:
    base = {**R1_DISTILL_QWEN_1_5B_JSON, "model_type": "llama"}
    assert _refused({**base, "attention_bias": True}).field == "attention_bias"
    assert _refused({**base, "mlp_bias": True}).field == "mlp_bias"
    assert _refused({**base, "model_type": "qwen3", "attention_bias": True}).field == (
        "attention_bias"
    )
    # Qwen2 has no such field: its q/k/v biases are always on, o_proj never has one.
    assert ModelConfig.from_hf_dict({**R1_DISTILL_QWEN_1_5B_JSON, "attention_bias": True}).qkv_bias
    with pytest.raises(UnsupportedConfigError):
        ModelConfig("llama", 64, 32, 48, 1, 4, 2, head_dim=8, attention_bias=True)


def test_linear_rope_scaling_matches_transformers() -> None:
    from transformers import Qwen2Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokencache_models.layers import rope_inv_freq

    hf_cfg = Qwen2Config(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "linear", "rope_theta": 1e6, "factor": 4.0},
    )
    ref, _ = ROPE_INIT_FUNCTIONS["linear"](hf_cfg, torch.device("cpu"))
    assert torch.equal(rope_inv_freq(ModelConfig.from_hf_dict(hf_cfg.to_dict())), ref)


# ---- the CUDA paths (Triton attention + fusions) under the interpreter ----

INTERPRET = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM
from tokencache_models import ForwardBatch, GreedyRunner, load_hf_checkpoint

path, prompts, expected = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
system, tails, expected_shared = (json.loads(a) for a in sys.argv[4:7])
hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
model = load_hf_checkpoint(path, attention_backend="triton")
ref = load_hf_checkpoint(path, attention_backend="torch")
assert model.attention().name == "triton" and ref.attention().name == "torch"
model.fused = True  # the CUDA defaults: Triton attention and the fused norm / RoPE / SwiGLU
runners = [GreedyRunner(m, m.make_kv_pool(256)) for m in (model, ref)]
rids = [[r.add_request(p) for p in prompts] for r in runners]
for step in range(len(expected[0])):  # a ragged prefill, then paged decode steps
    a, b = (r.step(ids) for r, ids in zip(runners, rids))
    err = (a.logits - b.logits).abs().max().item()
    assert err < 1e-4, (step, err)
got = [list(runners[0].requests[i].generated) for i in rids[0]]
assert got == expected, (got, expected)
# A catch-up of three tokens (varlen kernel over the paged prefix), then one more decode.
for r, ids in zip(runners, rids):
    r.extend(ids[0], [7, 8, 9])
a, b = (r.step(ids) for r, ids in zip(runners, rids))
assert (a.logits - b.logits).abs().max().item() < 1e-4

# Four requests on one 160-token system prompt (long enough to pay at fp32): their tails, then
# decode steps through the shared-prefix kernel (GQA group 3, padded); counted, so the test
# knows it ran in every decode step.
import tokencache_models.kernels.decode_attention as td
import tokencache_models.kernels.varlen_attention as tv

launches = []
for mod in (td, tv):
    real = mod.shared_prefix_partials
    def counted(*args, _real=real, **kwargs):
        launches.append(1)
        return _real(*args, **kwargs)
    mod.shared_prefix_partials = counted
shared = []
for r in runners:
    root = r.add_request(system)
    r.step([root])
    shared.append([r.add_request(system + t, root, len(system)) for t in tails])
for step in range(len(expected_shared[0])):
    a, b = (r.step(ids) for r, ids in zip(runners, shared))
    err = (a.logits - b.logits).abs().max().item()
    assert err < 1e-4, ("shared", step, err)
decodes = len(expected_shared[0]) - 1
assert len(launches) >= decodes * model.config.num_hidden_layers, launches
got = [list(runners[0].requests[i].generated) for i in shared[0]]
assert got == expected_shared, (got, expected_shared)
print("OK")
"""


def test_triton_and_fused_paths_in_interpreter(qwen2_ckpt: Qwen2Checkpoint) -> None:
    """Triton decode / varlen / shared-prefix attention and the fusions on one tiny shape
    (GQA group 3: padded in the kernels, as R1-Distill-Qwen's 6 and 5 are), token for token
    against transformers' greedy generation and within 1e-4 of the torch path each step."""
    pytest.importorskip("triton")
    if qwen2_ckpt.shape != "untied-gqa3-linear":
        pytest.skip("one shape is enough (kept fast)")
    prompts = _prompts(320, [5, 12], seed=9)
    n = 6
    expected = [hf_greedy(qwen2_ckpt.hf_model, p, n) for p in prompts]
    (system,) = _prompts(320, [160], seed=10)
    tails = [[i + 1] * (i + 1) for i in range(4)]
    expected_shared = [hf_greedy(qwen2_ckpt.hf_model, system + t, 3) for t in tails]
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": str(ROOT / "integrations"),
        "HF_HUB_OFFLINE": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            INTERPRET,
            str(qwen2_ckpt.path),
            json.dumps(prompts),
            json.dumps(expected),
            json.dumps(system),
            json.dumps(tails),
            json.dumps(expected_shared),
        ],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr
