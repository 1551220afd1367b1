"""`python -m tokencache_routing.bench`, the documented command: a thin entry module at the
old path; the code is tools/bench.py."""

from __future__ import annotations

from .tools.bench import main

if __name__ == "__main__":
    main()
