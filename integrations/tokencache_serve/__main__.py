"""`python -m tokencache_serve serve ...` (the `tokencache` console script)."""

import sys

from .cli import main

sys.exit(main())
