"""Checkpoint cost under decode: SGLang 0.5.23's RadixCache vs the tokencache backend.

One request decodes from a 256-token prompt to 8192 tokens, checkpointing after every token
(SGLang's `checkpoint(req, up_to=...)`); every 20 tokens another request's match splits its path,
so the path deepens as it does under token routing. Prints the median checkpoint time in the
100 tokens before L = 512, 2048 and 8192. Reuses the simulated request harness of tests/sglang.

    python benches/sglang_checkpoint.py
"""

from __future__ import annotations

import sys
import time
from array import array
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "integrations"), str(ROOT / "tests" / "sglang")]

from tokencache_sglang.sglang_import import import_sglang  # noqa: E402

import_sglang()

import numpy as np  # noqa: E402
import sgl_harness as H  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams  # noqa: E402
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # noqa: E402

from tokencache_sglang.cache import TokenCacheRadixCache  # noqa: E402

LENGTHS = (512, 2048, 8192)


class BigRows(H.RowPool):
    def __init__(self) -> None:
        self.req_to_token = torch.zeros((4, max(LENGTHS) + 128), dtype=torch.int32)


def side(factory: object) -> H.Side:
    alloc = H.RecordingAllocator(1)
    rows = BigRows()
    cache = factory(alloc)  # type: ignore[operator]
    cache.req_to_token_pool = rows
    return H.Side(cache, alloc, rows)


def sglang_cache(alloc: object) -> RadixCache:
    params = CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=alloc, page_size=1
    )
    return RadixCache(params)


def ours(alloc: object) -> TokenCacheRadixCache:
    return TokenCacheRadixCache.create_simulated(mock_allocator=alloc, page_size=1)


def main() -> None:
    seq = np.random.default_rng(0).integers(1, 30000, max(LENGTHS) + 100).astype(np.int64)
    print("median microseconds per checkpoint (1 new token), by context length")
    for name, s in [("sglang RadixCache", side(sglang_cache)), ("tokencache backend", side(ours))]:
        src = H.SlotSource(1)
        s.start("a", seq, 256, 0, 0)
        s.extend("a", 256, src)
        times: dict[int, list[int]] = {}
        for end in range(257, max(LENGTHS) + 1):
            req = s.reqs["a"]
            s.write_new_slots(req, end, src)
            req.committed = end
            req.full_untruncated_fill_ids = array("q", seq[:end].tolist())
            t0 = time.perf_counter_ns()
            s.cache.checkpoint(req, up_to=end)
            dt = time.perf_counter_ns() - t0
            for length in LENGTHS:
                if length - 100 <= end <= length:
                    times.setdefault(length, []).append(dt)
            if end % 20 == 0:  # another request's match splits the path here
                key = RadixKey(array("q", seq[: end - 5].tolist()))
                s.cache.match_prefix(MatchPrefixParams(key=key))
        cells = "  ".join(f"L={k}: {np.median(v) / 1e3:,.1f}" for k, v in times.items())
        print(f"{name:>20}  {cells}")


if __name__ == "__main__":
    main()
