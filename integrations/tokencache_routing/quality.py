"""`python -m tokencache_routing.quality`, the documented command: a thin entry module at the
old path; the code is tools/quality.py."""

from __future__ import annotations

from .tools.quality import main

if __name__ == "__main__":
    main()
