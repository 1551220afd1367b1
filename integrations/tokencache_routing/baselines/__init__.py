"""What the engine is compared against: the naive dispatcher's KV protocol (naive.py), the same
through SGLang's own RadixCache (naive_sglang.py), and the step-by-step reference generation
the exactness tests hold the engine to (reference.py)."""
