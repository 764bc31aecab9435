from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from helpers import TARGET_IDS, Target, make_target  # noqa: E402

import pinstage._buffers as _buffers  # noqa: E402

_ENV = ("PINSTAGE_PIN_MEMORY", "PINSTAGE_UVA", "PINSTAGE_STAGING_LIMIT")


@pytest.fixture(autouse=True)
def _reset_global_state(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in _ENV:
        monkeypatch.delenv(name, raising=False)
    saved = _buffers._DEFAULT_MAX_CONCURRENCY
    yield
    _buffers._DEFAULT_MAX_CONCURRENCY = saved


@pytest.fixture
def quiet_gc() -> Iterator[None]:
    """The process-wide pinned-memory counters move when garbage from earlier tests is
    collected: collect it first, and keep the collector off while a test compares them."""
    import gc

    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture(params=TARGET_IDS)
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    with make_target(request.param) as t:
        yield t


@pytest.fixture(params=[n for n in TARGET_IDS if n.startswith("sim")])
def sim_target(request: pytest.FixtureRequest) -> Iterator[Target]:
    with make_target(request.param) as t:
        yield t


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA/ROCm device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
