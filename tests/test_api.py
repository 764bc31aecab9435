"""The public surface: exported names, import without device work."""

from __future__ import annotations

import subprocess
import sys

import pinstage

CONTRACT_NAMES = {
    "capabilities", "Capabilities", "is_pin_memory_available", "is_uva_available",
    "PIN_MEMORY", "async_tensor_h2d", "np_to_pinned_tensor", "CpuGpuBuffer", "UvaBuffer",
    "NonUvaBuffer", "UvaBufferPool", "UvaBackedTensor", "StagedWriteTensor",
    "set_default_max_concurrency", "h2d_many", "host_memory_stats", "audit",
    "HiddenSyncError", "synchronize",
    # section 8: vLLM compatibility
    "FusedStagedWriter", "async_copy_to_gpu", "get_accelerator_view_from_cpu_tensor",
}


def test_all_is_exactly_the_public_names():
    extra = {"Finding", "SyncReport", "PinstageError", "ValueOverflowError", "NotANumberError",
             "UnavailableError", "CaptureError", "BusyError", "DriverError"}
    assert set(pinstage.__all__) == CONTRACT_NAMES | extra
    for name in pinstage.__all__:
        assert hasattr(pinstage, name), name
    assert pinstage.__all__ == sorted(pinstage.__all__)


def test_testing_module():
    from pinstage import testing

    assert callable(testing.simulated_accelerator)
    assert issubclass(testing.HazardError, RuntimeError)


def test_import_touches_no_device():
    code = (
        "import sys, torch, pinstage, pinstage.testing\n"
        "assert not torch.cuda.is_initialized()\n"
        "assert 'pinstage._cuda' not in sys.modules\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr


def test_py_typed_ships():
    import importlib.resources

    assert importlib.resources.files("pinstage").joinpath("py.typed").is_file()


def test_errors_live_at_public_paths():
    """Every error users catch is importable from ``pinstage`` (``HazardError`` from
    ``pinstage.testing``) and says so in its ``__module__``; all derive from PinstageError."""
    from pinstage import testing

    for name in ("PinstageError", "ValueOverflowError", "NotANumberError", "UnavailableError",
                 "CaptureError", "BusyError", "DriverError", "HiddenSyncError"):
        cls = getattr(pinstage, name)
        assert cls.__module__ == "pinstage", name
        assert issubclass(cls, pinstage.PinstageError), name
    assert testing.HazardError.__module__ == "pinstage.testing"
    assert issubclass(pinstage.NotANumberError, TypeError)
    assert issubclass(pinstage.NotANumberError, ValueError)
    assert issubclass(pinstage.ValueOverflowError, OverflowError)
    for name in ("UnavailableError", "CaptureError", "BusyError", "DriverError"):
        assert issubclass(getattr(pinstage, name), RuntimeError), name
    assert pinstage.UnavailableError("x", ["why"]).reasons == ("why",)


def test_no_import_cycle():
    """No cycle among pinstage's modules, counting imports inside functions."""
    import pathlib

    script = pathlib.Path(__file__).parents[1] / "scripts" / "import_graph.py"
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
