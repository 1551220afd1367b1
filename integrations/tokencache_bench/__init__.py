"""Standalone microbenchmarks: tokencache beside SGLang's prefix caches on one routing trace."""
