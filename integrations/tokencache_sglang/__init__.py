"""tokencache as SGLang's radix cache: ``--radix-cache-backend tokencache``.

Import ``tokencache_sglang.stubs`` and call ``install()`` before ``import sglang`` on hosts
without a loadable torchvision; ``cache`` and ``plugin`` import sglang.
"""
