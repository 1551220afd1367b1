"""`python -m tokencache_routing.demo`, the documented command: a thin entry module at the
old path; the code is tools/demo.py."""

from __future__ import annotations

from .tools.demo import main

if __name__ == "__main__":
    main()
