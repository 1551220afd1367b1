"""Child process for one RSS measurement: `python -m tokencache_bench.rss_child KEY JSON`.

A fresh process per implementation, so no other tree's freed-but-resident memory hides the
growth. Prints one JSON line: {"name", "bytes_per_token", "cached_tokens"}.
"""

from __future__ import annotations

import json
import sys

from tokencache_bench.impls import IMPLS, factory
from tokencache_bench.replay import replay
from tokencache_bench.trace import TraceConfig, make_trace, take_gen, take_requests


def main(argv: list[str]) -> int:
    key, spec = argv[0], json.loads(argv[1])
    impl = next(i for i in IMPLS if i.key == key)
    if impl.needs == "sglang" or impl.needs.startswith("tokencache_sglang"):
        from tokencache_sglang.sglang_import import import_sglang

        import_sglang()  # before the baseline: the import is not the tree
    config = TraceConfig(**{**spec["config"], "buckets": tuple(spec["config"]["buckets"])})
    trace = take_gen(take_requests(make_trace(config), spec["requests"]), spec["max_gen"])
    cls = factory(impl)
    replay(cls, take_gen(take_requests(trace, 2), 64))  # one-time native set-up
    t = replay(cls, trace)
    out = {
        "name": t.name,
        "bytes_per_token": max(t.rss_growth_bytes, 0) / t.cached_tokens,
        "cached_tokens": t.cached_tokens,
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
