"""Triton kernels: paged attention (decode, varlen, shared prefix) and the layer fusions.

Imported lazily, on CUDA or under TRITON_INTERPRET=1: CPU-only users never load triton.
"""
