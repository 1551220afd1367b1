"""`python -m tokencache_bench`: same as the tokencache-bench console script."""

from tokencache_bench.cli import main

raise SystemExit(main())
