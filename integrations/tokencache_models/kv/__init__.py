"""KV memory: the per-model slot pool and the request-to-slot table."""
