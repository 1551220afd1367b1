"""Shared-prefix attention, host side: which rows share a prefix, and how the kernel runs."""
