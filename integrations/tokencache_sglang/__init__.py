"""tokencache as SGLang's radix cache: ``--radix-cache-backend tokencache``.

``cache`` and ``plugin`` import sglang; they go through :mod:`tokencache_sglang.sglang_import`,
the project's one way to import SGLang (it stubs ``torchvision`` first on CPU-only hosts).
"""
