"""`python -m tokencache_routing.train_router`, the documented command: a thin entry module at the
old path; the code is tools/train_router.py."""

from __future__ import annotations

from .tools.train_router import main

if __name__ == "__main__":
    main()
