"""The README's openai-client example runs as written against a live server (tiny models; only
the address and model name are swapped for the test server's)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import MODEL, serve

README = Path(__file__).resolve().parents[2] / "integrations" / "tokencache_serve" / "README.md"


def test_readme_python_example(tiny: Any, capsys: pytest.CaptureFixture[str]) -> None:
    (code,) = re.findall(r"^```python\n(.*?)^```", README.read_text(), re.DOTALL | re.MULTILINE)
    assert "http://127.0.0.1:8000/v1" in code and '"tokencache-routed"' in code
    with serve(tiny) as served:
        code = code.replace("http://127.0.0.1:8000", served.url)
        code = code.replace('"tokencache-routed"', repr(MODEL))
        exec(compile(code, str(README), "exec"), {"__name__": "readme_example"})
        served.wait_idle()
    out = capsys.readouterr().out
    assert re.search(r"\d+ of \d+ tokens from the large model", out)
