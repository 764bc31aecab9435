"""pytest plugin (registered through the ``pytest11`` entry point): the ``no_hidden_syncs``
fixture fails the test that uses it if the hidden-sync audit finds anything inside it."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import pytest


@pytest.fixture
def no_hidden_syncs() -> Iterator[Any]:
    """Run the test under ``pinstage.audit()``; the test fails, with the audit's summary, if
    anything inside it makes the host wait for the device. Yields the live report."""
    from pinstage import audit

    with audit() as report:
        yield report


def _check(item: pytest.Item) -> None:
    report = getattr(item, "funcargs", {}).get("no_hidden_syncs")
    if report is not None and report.findings:
        pytest.fail(report.summary(), pytrace=False)


try:  # pytest >= 8 (pluggy >= 1.2): fail in the call phase, so the test itself fails
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
        result = yield
        _check(item)
        return result
except (TypeError, ValueError):  # older pytest: fail at teardown instead
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, None]:
        _check(item)
        yield
