"""A model whose device work is stubbed: the host path alone, at any size, on any machine.

CausalLM.execute (the forward body, or a CUDA graph's replay) returns zero logits and hidden
states at once, with the step's epilogue over them (greedy tokens, entropy: device work, in
the graph on a GPU); everything before it (the runner's host preparation) runs for real. The
host-path benchmarks time an engine's step this way, apart from a CPU model's own forward,
which on this machine would both cost milliseconds and evict the host's caches between steps
(a GPU's forward does neither to the host). Greedy draws then pick token 0 everywhere."""

from __future__ import annotations

import types

import torch

from .context import ForwardOutput
from .executor import PreparedStep
from .model import CausalLM


def stub_execute(model: CausalLM) -> CausalLM:
    """The model (changed in place) with execute() returning zeros for its real rows."""
    hidden, vocab = model.config.hidden_size, model.config.vocab_size

    def execute(self: CausalLM, step: PreparedStep) -> ForwardOutput:
        n = step.static.num_real if step.static is not None else step.context.num_real  # type: ignore[union-attr]
        out = ForwardOutput(logits=torch.zeros(n, vocab), hidden=torch.zeros(n, hidden))
        # The epilogue is device work too (in the step's graph on a GPU): computed here.
        return step.epilogue.apply(out) if step.epilogue is not None else out

    model.execute = types.MethodType(execute, model)  # type: ignore[method-assign]
    return model
