"""What every test folder shares (each folder's own conftest.py holds its fixtures)."""

from __future__ import annotations

import pytest

# pytest-timeout fails a hung test after 300 s (pyproject.toml). These files run Triton kernels
# in its Python interpreter, or compile them, in subprocesses under their own limits (600 s,
# 840 s; one passed 300 s on a slow shared machine): those limits are to fail first, so the
# files keep a 900 s budget. A test's own timeout mark wins.
LONG_BUDGET_S = {
    "tests/models/test_triton_interpret.py": 900,
    "tests/models/test_triton_compile.py": 900,
    "tests/models/test_extend_graphs.py": 900,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        budget = LONG_BUDGET_S.get(item.nodeid.split("::")[0])
        if budget is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(budget))
