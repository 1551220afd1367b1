"""Where the two models go and how many KV slots each pool gets from the GPU's memory.

SGLang's --mem-fraction-static and vLLM's --gpu-memory-utilization are the convention: of a
device's total memory, that fraction holds what stays for the server's life (the weights on
it and the KV pools); the rest is left to activations, CUDA graphs and the allocator. Both
models cache the same sequences, so on one device their pools get the same number of slots
(the budget over the sum of their bytes per slot); on two devices each pool takes its own
device's budget. A pair that leaves no room is refused with the numbers, before anything is
served.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only where memory is asked: the CLI's --help imports this module
    import torch

DEFAULT_MEM_FRACTION = 0.85
# A pool this small serves hardly one request: refused rather than started.
MIN_SLOTS = 4096
GIB = float(1 << 30)


@dataclass(frozen=True)
class PoolNeed:
    """One model's side: its name, the device its pool lives on, its KV bytes per slot."""

    name: str
    device: torch.device
    bytes_per_slot: int


def cuda_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use by tensors) bytes of a CUDA device."""
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    return int(total), int(torch.cuda.memory_allocated(device))


def kv_slots(
    needs: Sequence[PoolNeed],
    fraction: float = DEFAULT_MEM_FRACTION,
    memory: Callable[[torch.device], tuple[int, int]] = cuda_memory,
    min_slots: int = MIN_SLOTS,
) -> dict[str, int]:
    """Slots of each pool: per device, fraction x its total memory less what its tensors (the
    weights loaded so far) use, shared by the pools on it in equal slot counts. ValueError
    naming the numbers when a device leaves fewer than min_slots."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--mem-fraction-static must be in (0, 1], got {fraction}")
    out: dict[str, int] = {}
    devices = list(dict.fromkeys(n.device for n in needs))
    for device in devices:
        mine = [n for n in needs if n.device == device]
        total, used = memory(device)
        budget = int(fraction * total) - used
        per_slot = sum(n.bytes_per_slot for n in mine)
        slots = budget // per_slot if budget > 0 else 0
        if slots < min_slots:
            names = " and ".join(n.name for n in mine)
            raise ValueError(
                f"not enough memory on {device} for the {names} model's KV pool: "
                f"{fraction:.2f} x {total / GIB:.1f} GiB = {fraction * total / GIB:.1f} GiB, of "
                f"which the weights already use {used / GIB:.1f} GiB, leaves "
                f"{max(budget, 0) / GIB:.2f} GiB = {slots} slots at {per_slot} bytes a slot "
                f"(at least {min_slots} needed): raise --mem-fraction-static, give the "
                "--num-slots yourself, or place the large model on another GPU (--large-device)"
            )
        for n in mine:
            out[n.name] = int(slots)
    return out
