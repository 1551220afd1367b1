"""Per-model paged KV storage: one slot holds one token's K and V for every layer."""

from __future__ import annotations

import numpy as np
import torch

from ..arrays import has_duplicates
from ..config import ModelConfig


class SlotAllocator:
    """Exact free-slot accounting over [0, num_slots); slot ids are CPU int64 tensors (or
    numpy arrays: alloc_array / free_array, what the engine's host path uses).

    A stack of free ids plus an in-use bitmap, both numpy: alloc/free are vectorised (no
    per-slot Python work, a few microseconds a call), and the bitmap catches double frees and
    frees of never-allocated slots.
    """

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("num_slots must be positive")
        self.num_slots = num_slots
        # Reversed so that the first allocations get the lowest ids (easier to read in tests).
        self._free = np.arange(num_slots - 1, -1, -1, dtype=np.int64)
        self._top = num_slots
        self._in_use = np.zeros(num_slots, dtype=bool)

    @property
    def available(self) -> int:
        return self._top

    @property
    def used(self) -> int:
        return self.num_slots - self._top

    def alloc_array(self, n: int) -> np.ndarray:
        if n < 0:
            raise ValueError("n must be non-negative")
        if n > self._top:
            raise MemoryError(f"KV pool exhausted: requested {n} slots, {self._top} available")
        slots: np.ndarray = self._free[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._in_use[slots] = True
        return slots

    def alloc(self, n: int) -> torch.Tensor:
        return torch.from_numpy(self.alloc_array(n))

    def free_array(self, slots: np.ndarray) -> None:
        slots = np.asarray(slots, dtype=np.int64).reshape(-1)
        n = len(slots)
        if n == 0:
            return
        if int(slots.min()) < 0 or int(slots.max()) >= self.num_slots:
            raise ValueError("slot id out of range")
        if has_duplicates(slots):
            raise ValueError("duplicate slot ids in one free() call")
        if not bool(self._in_use[slots].all()):
            raise ValueError("double free: some slots are not allocated")
        self._in_use[slots] = False
        self._free[self._top : self._top + n] = slots[::-1]
        self._top += n

    def free(self, slots: torch.Tensor | np.ndarray) -> None:
        if isinstance(slots, torch.Tensor):
            slots = slots.detach().cpu().numpy()
        self.free_array(slots)

    def is_allocated(self, slots: torch.Tensor) -> torch.Tensor:
        idx = torch.as_tensor(slots, dtype=torch.int64).cpu().numpy()
        return torch.from_numpy(self._in_use[idx].copy())


class KVPool:
    """K and V tensors of shape [layers, slots, kv_heads, head_dim] plus their slot allocator.

    `k` / `v` are views of `k_store` / `v_store`, which hold one more row (the scratch slot).
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        # One hidden row past the last slot: the scratch slot that padding rows of a padded
        # (CUDA-graph) decode batch write to. It is never allocated and never counted.
        shape = (num_layers, num_slots + 1, num_kv_heads, head_dim)
        # Zeros, not empty: a slot read before being written must not inject NaNs.
        self.k_store = torch.zeros(shape, device=device, dtype=dtype)
        self.v_store = torch.zeros(shape, device=device, dtype=dtype)
        self.k = self.k_store[:, :num_slots]  # the public [layers, slots, kv_heads, head_dim]
        self.v = self.v_store[:, :num_slots]
        self.allocator = SlotAllocator(num_slots)

    @classmethod
    def for_config(
        cls,
        config: ModelConfig,
        num_slots: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> KVPool:
        return cls(
            config.num_hidden_layers,
            num_slots,
            config.num_key_value_heads,
            config.head_dim,
            device,
            dtype,
        )

    @staticmethod
    def bytes_per_slot(config: ModelConfig, dtype: torch.dtype) -> int:
        return config.kv_elems_per_token * torch.empty((), dtype=dtype).element_size()

    @classmethod
    def from_budget(
        cls,
        config: ModelConfig,
        budget_bytes: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> KVPool:
        """As many slots as fit in budget_bytes (K and V together, all layers)."""
        num_slots = budget_bytes // cls.bytes_per_slot(config, dtype)
        if num_slots <= 0:
            raise ValueError(f"budget of {budget_bytes} bytes holds no KV slot")
        return cls.for_config(config, int(num_slots), device, dtype)

    @property
    def num_slots(self) -> int:
        return self.k.shape[1]

    @property
    def scratch_slot(self) -> int:
        """Row of k_store / v_store that padding tokens write to; outside [0, num_slots)."""
        return self.k.shape[1]

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def nbytes(self) -> int:
        """Bytes of the allocatable slots (the scratch row adds one token's worth)."""
        return self.k.numel() * self.k.element_size() * 2

    def alloc(self, n: int) -> torch.Tensor:
        return self.allocator.alloc(n)

    def alloc_array(self, n: int) -> np.ndarray:
        """alloc() as a numpy array (the engine's host path: no tensor made per step)."""
        return self.allocator.alloc_array(n)

    def free(self, slots: torch.Tensor | np.ndarray) -> None:
        self.allocator.free(slots)

    @property
    def available(self) -> int:
        return self.allocator.available
