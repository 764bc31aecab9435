"""pytest plugin (registered through the ``pytest11`` entry point).

* ``no_hidden_syncs`` - fails the test that uses it if the hidden-sync audit finds anything.
* ``simulated_cuda`` - runs one test inside ``pinstage.testing.simulated_accelerator()`` and
  yields the simulator.
* ``--pinstage-simulate[=MODE]`` (``lazy`` by default; ``--pinstage-seed N``) - every test
  runs inside a simulated CUDA, so tests written for a GPU, including those that skip when
  ``torch.cuda.is_available()`` is false, run in CPU-only CI and fail on async bugs.
"""

from __future__ import annotations

import os
from collections.abc import Generator, Iterator
from typing import Any

import pytest

_MODES = ("eager", "lazy", "random")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pinstage")
    group.addoption("--pinstage-simulate", nargs="?", const="lazy", default=None,
                    metavar="MODE",
                    help="run every test inside pinstage's simulated CUDA; MODE is eager, "
                         "lazy (the default) or random")
    group.addoption("--pinstage-seed", type=int, default=0, metavar="N",
                    help="seed of the simulated CUDA's random mode (default 0)")
    group.addoption("--pinstage-devices", type=int, default=1, metavar="N",
                    help="number of simulated CUDA devices (default 1; multi-GPU tests need 2)")


@pytest.fixture
def no_hidden_syncs() -> Iterator[Any]:
    """Run the test under ``pinstage.audit()``; the test fails, with the audit's summary, if
    anything inside it makes the host wait for the device. Yields the live report."""
    from pinstage import audit

    with audit() as report:
        yield report


@pytest.fixture
def simulated_cuda(request: pytest.FixtureRequest) -> Iterator[Any]:
    """A simulated CUDA for this test (``--pinstage-simulate``'s mode and seed, else lazy and
    0); yields the simulator. Inside ``--pinstage-simulate`` it yields the one already open."""
    from pinstage import _sim

    if _sim.current() is not None:
        yield _sim.current()
        return
    mode = request.config.getoption("pinstage_simulate") or "lazy"
    with _open(request.config, mode) as s:
        yield s


def _check(item: pytest.Item) -> None:
    report = getattr(item, "funcargs", {}).get("no_hidden_syncs")
    if report is not None and report.findings:
        pytest.fail(report.summary(), pytrace=False)


def _mode_word(config: pytest.Config) -> tuple[str, bool] | None:
    """The word argparse took as ``--pinstage-simulate``'s value, and whether it was given as
    ``--pinstage-simulate=WORD`` (then it can only be a mode) rather than as the next word (a
    test path there is not a mode; argparse cannot tell). None: the flag was not given."""
    args = [str(a) for a in config.invocation_params.args]
    found: tuple[str, bool] | None = None
    for i, a in enumerate(args):
        if a.startswith("--pinstage-simulate="):
            found = (a.split("=", 1)[1], True)
        elif a == "--pinstage-simulate" and i + 1 < len(args):
            found = (args[i + 1], False)
    return found


def _looks_like_a_path(word: str, config: pytest.Config) -> bool:
    """Whether ``word`` names a test path (``dir/``, ``x.py``, ``x.py::test``, or anything that
    exists relative to where pytest was invoked)."""
    path = word.split("::", 1)[0]
    return ("/" in path or os.sep in path or path.endswith(".py") or "::" in word
            or os.path.exists(os.path.join(str(config.invocation_params.dir), path)))


def _open(config: pytest.Config, mode: str) -> Any:
    """The simulator the options ask for (``--pinstage-seed``, ``--pinstage-devices``)."""
    from pinstage.testing import simulated_accelerator

    devices = config.getoption("pinstage_devices", default=1)
    if not isinstance(devices, int) or devices < 1:
        raise pytest.UsageError(f"--pinstage-devices must be an int >= 1, got {devices!r}")
    return simulated_accelerator(mode=mode, seed=int(config.getoption("pinstage_seed",
                                                                      default=0)),
                                 device_count=devices)


def _simulating(config: pytest.Config) -> str | None:
    mode = config.getoption("pinstage_simulate", default=None)
    return mode if isinstance(mode, str) else None


def pytest_configure(config: pytest.Config) -> None:
    """With ``--pinstage-simulate``, collection runs inside a simulator too: skip conditions
    written as ``skipif(not torch.cuda.is_available())`` are evaluated at import."""
    mode = _simulating(config)
    if mode is not None and mode not in _MODES:
        given = _mode_word(config)
        explicit = given is None or given[1] or mode.startswith("-")
        if explicit or not _looks_like_a_path(mode, config):
            raise pytest.UsageError(f"--pinstage-simulate: unknown mode {mode!r}; MODE must be "
                                    f"one of {', '.join(_MODES)} (e.g. "
                                    "--pinstage-simulate=random)")
        # `--pinstage-simulate tests/x.py`: the word after the bare flag was a path, not a mode
        config.option.pinstage_simulate = mode = "lazy"
        if config.args_source != pytest.Config.ArgsSource.ARGS:  # testpaths or the cwd
            config.args.clear()
        config.args.append(given[0] if given is not None else mode)
    if mode is not None:

        cm = _open(config, mode)
        cm.__enter__()
        config._pinstage_collect_sim = cm  # type: ignore[attr-defined]


def _close_collection_sim(config: pytest.Config) -> None:
    cm = getattr(config, "_pinstage_collect_sim", None)
    if cm is not None:
        del config._pinstage_collect_sim  # type: ignore[attr-defined]
        cm.__exit__(None, None, None)


def pytest_collection_finish(session: pytest.Session) -> None:
    _close_collection_sim(session.config)


def pytest_unconfigure(config: pytest.Config) -> None:
    _close_collection_sim(config)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Generator[None, Any, None]:
    """With ``--pinstage-simulate``, open the simulator before fixtures and skip markers are
    evaluated, so ``torch.cuda.is_available()`` is already true there."""
    mode = _simulating(item.config)
    if mode is not None:

        cm = _open(item.config, mode)
        cm.__enter__()
        item._pinstage_sim = cm  # type: ignore[attr-defined]
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Generator[None, Any, None]:
    yield
    cm = getattr(item, "_pinstage_sim", None)
    if cm is not None:
        del item._pinstage_sim  # type: ignore[attr-defined]
        cm.__exit__(None, None, None)  # runs what is queued: a hazard fails the teardown


try:  # pytest >= 8 (pluggy >= 1.2): fail in the call phase, so the test itself fails
    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(item: pytest.Item) -> Generator[None, Any, Any]:
        result = yield
        _check(item)
        return result
except (TypeError, ValueError):  # older pytest: fail at teardown instead
    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(item: pytest.Item) -> Generator[None, Any, None]:
        _check(item)
        yield
