"""A model whose device work is stubbed: the host path alone, at any size, on any machine.

CausalLM.execute (the forward body, or a CUDA graph's replay) returns zero logits and hidden
states at once, with the step's epilogue over them (greedy tokens, entropy: device work, in
the graph on a GPU); everything before it (the runner's host preparation) runs for real. The
host-path benchmarks time an engine's step this way, apart from a CPU model's own forward,
which on this machine would both cost milliseconds and evict the host's caches between steps
(a GPU's forward does neither to the host). Greedy draws then pick token 0 everywhere.

Whose host preparation: `runner="eager"` keeps the model's own (on this CPU the torch
backend's eager path: ForwardContext.build each step); `runner="gpu"` prepares what the model
would on a GPU: the Triton backend's plan and shared-prefix tables, decode steps padded to a
bucket and loaded into a graph runner's static buffers (executor.decode_graphs.DecodeGraphRunner,
without capturing: there is nothing to replay), multi-token forwards laid out in the multi-token
runner's (executor.extend_graphs.ExtendGraphRunner)."""

from __future__ import annotations

import types

import torch

from ..executor.model_executor import PreparedStep
from ..forward.context import ForwardOutput
from ..model import CausalLM

RUNNERS = ("eager", "gpu")


def stub_execute(model: CausalLM, runner: str = "eager") -> CausalLM:
    """The model (changed in place) with execute() returning zeros for its real rows, its host
    preparation the `runner`'s (RUNNERS: see the module's docstring)."""
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {RUNNERS}, got {runner!r}")
    hidden, vocab = model.config.hidden_size, model.config.vocab_size

    def execute(self: CausalLM, step: PreparedStep) -> ForwardOutput:
        n = next(s.num_real for s in (step.static, step.extend, step.context) if s is not None)
        out = ForwardOutput(logits=torch.zeros(n, vocab), hidden=torch.zeros(n, hidden))
        # The epilogue is device work too (in the step's graph on a GPU): computed here.
        return step.epilogue.apply(out) if step.epilogue is not None else out

    model.execute = types.MethodType(execute, model)  # type: ignore[method-assign]
    if runner == "gpu":
        _gpu_host_path(model)
    return model


def _gpu_host_path(model: CausalLM) -> None:
    """The model prepares its forwards as on a GPU, on whatever device it is on."""
    model.attention_backend_name = "triton"  # its host plan: the shared-prefix tables
    executor = model.executor
    executor.decode_padding = True
    executor.decode_runner = True  # the graph runner's static path, without capture
    executor.extend_runner = True  # and the multi-token one's
