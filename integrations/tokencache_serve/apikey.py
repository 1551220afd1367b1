"""Where the server's API key comes from: --api-key, else the TOKENCACHE_API_KEY variable.

Its own module so that the command line and the replica supervisor both read it without
importing each other."""

from __future__ import annotations

import argparse
import os

API_KEY_ENV = "TOKENCACHE_API_KEY"


def api_key(a: argparse.Namespace) -> str | None:
    key: str | None = a.api_key if a.api_key is not None else os.environ.get(API_KEY_ENV)
    return key or None
