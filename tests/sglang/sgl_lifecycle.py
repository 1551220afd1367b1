"""A miniature scheduler that drives a prefix cache only through SGLang's own helpers.

Requests are real ``sglang...schedule_batch.Req`` objects, memory is a real
``PagedTokenToKVPoolAllocator`` and ``ReqToTokenPool``; the tree is touched only through
``Req.init_next_round_input`` (match_kv_cache), ``BasePrefixCache.lock``/``prefix_device_indices``
(admission), ``common.checkpoint_kv_cache`` (chunked prefill), ``tree_cache.checkpoint``
(decode hand-off), ``common.release_kv_cache`` (finish / abort), ``schedule_batch.release_req``
(retraction) and ``common.evict_from_tree_cache`` (allocation pressure).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from sglang.srt.managers.schedule_batch import FINISH_ABORT, FINISH_LENGTH, Req, release_req
from sglang.srt.mem_cache import common
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams

POOL_TOKENS = 1536
MAX_CONTEXT = 512
CHUNK = 64


class MiniScheduler:
    def __init__(self, make_cache: Callable[[CacheInitParams], Any], page_size: int) -> None:
        self.page_size = page_size
        self.allocator = PagedTokenToKVPoolAllocator(
            size=POOL_TOKENS,
            page_size=page_size,
            dtype=torch.float16,
            device="cpu",
            kvcache=None,
            need_sort=False,
        )
        self.rows = ReqToTokenPool(
            size=32, max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False
        )
        self.cache = make_cache(
            CacheInitParams(
                disable=False,
                req_to_token_pool=self.rows,
                token_to_kv_pool_allocator=self.allocator,
                page_size=page_size,
            )
        )
        self.running: list[Req] = []
        self.prefill_end: dict[str, int] = {}
        self.retracted = 0

    # ----- accounting -----

    def idle_ok(self) -> tuple[int, int, int]:
        """(available + evictable, protected, pool size): SGLang's idle leak check."""
        return (
            self.allocator.available_size() + self.cache.evictable_size(),
            self.cache.protected_size(),
            POOL_TOKENS,
        )

    # ----- memory -----

    def _alloc_positions(self, req: Req, start: int, end: int) -> bool:
        """Slots for row positions [start, end): continue the open page, then whole pages."""
        ps = self.page_size
        row = self.rows.req_to_token[req.kv.req_pool_idx]
        first_new = min(end, -(-start // ps) * ps)
        new_pages = -(-(end - first_new) // ps)
        if new_pages:
            need = new_pages * ps
            if self.allocator.available_size() < need:
                common.evict_from_tree_cache(self.cache, need)
            slots = self.allocator.alloc(need)
            if slots is None:
                return False
            row[first_new:end] = slots[: end - first_new].to(row.dtype)
        if first_new > start:
            base = int(row[start - 1])
            row[start:first_new] = torch.arange(base + 1, base + 1 + first_new - start)
        req.kv.kv_allocated_len = end
        req.kv.kv_committed_len = end
        return True

    # ----- lifecycle -----

    def admit(
        self, rid: str, prompt: np.ndarray, max_new: int, extra_key: str | None = None
    ) -> Req | None:
        req = Req(
            rid,
            "",
            array("q", prompt.tolist()),
            SamplingParams(max_new_tokens=max_new),
            extra_key=extra_key,
        )
        return req if self._admit(req) else None

    def _admit(self, req: Req) -> bool:
        req.init_next_round_input(self.cache)
        # This round prefills the whole fill (prompt, plus outputs after a retraction).
        self.prefill_end[req.rid] = len(req.full_untruncated_fill_ids)
        req.extend_end = min(self.prefill_end[req.rid], req.prefix_len + CHUNK)
        req.lock = self.cache.lock(req.last_node)
        self.rows.alloc([req])
        prefix = self.cache.prefix_device_indices(req)
        self.rows.write((req.kv.req_pool_idx, slice(0, req.prefix_len)), prefix.to(torch.int32))
        if not self._alloc_positions(req, req.prefix_len, req.extend_end):
            # Out of memory: the scheduler would not have admitted it; undo the lock and row.
            self.cache.unlock(req.lock)
            req.lock = None
            self.rows.free(req)
            return False
        self.running.append(req)
        return True

    def step(self, req: Req, rng: np.random.Generator, handoff: bool) -> bool:
        """One forward for req: the next prefill chunk, or one decode token. False if OOM."""
        prefill_end = self.prefill_end[req.rid]
        if req.extend_end < prefill_end:  # the previous chunk ran: publish it
            common.checkpoint_kv_cache(req, self.cache)
            start = req.extend_end
            req.extend_end = min(prefill_end, start + CHUNK)
            return self._alloc_positions(req, start, req.extend_end)
        if req.kv.kv_committed_len == prefill_end:  # the last chunk ran; a token comes out
            req.output_ids.append(int(rng.integers(1, 50)))
            self.prefill_end[req.rid] = -1
            return True
        pos = req.kv.kv_committed_len
        if not self._alloc_positions(req, pos, pos + 1):
            return False
        req.output_ids.append(int(rng.integers(1, 50)))
        if handoff:
            # A token-routing hand-off: publish everything computed so far.
            req.refresh_fill_ids()
            self.cache.checkpoint(req, up_to=req.kv.kv_committed_len)
        return True

    def done(self, req: Req) -> bool:
        return len(req.output_ids) >= req.sampling_params.max_new_tokens

    def finish(self, req: Req) -> None:
        req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
        self.running.remove(req)
        common.release_kv_cache(req, self.cache, checkpoint=True)

    def abort(self, req: Req) -> None:
        req.finished_reason = FINISH_ABORT("test abort")
        self.running.remove(req)
        common.release_kv_cache(req, self.cache, checkpoint=False)

    def retract(self, req: Req) -> None:
        self.running.remove(req)
        release_req(
            req=req,
            remaing_req_count=len(self.running),
            req_to_token_pool=self.rows,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.cache,
            hisparse_coordinator=None,
        )
        self.retracted += 1

    def readmit(self, req: Req) -> bool:
        return self._admit(req)
