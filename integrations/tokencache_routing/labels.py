"""`python -m tokencache_routing.labels`, the documented command: a thin entry module at the
old path; the code is tools/labels.py."""

from __future__ import annotations

from .tools.labels import main

if __name__ == "__main__":
    main()
