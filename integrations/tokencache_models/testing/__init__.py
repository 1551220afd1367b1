"""Helpers for tests, examples and benchmarks (the engine never imports them): a greedy
generation loop, a device stubbed out for host-path timing, a kernel-launch counter."""
