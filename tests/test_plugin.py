"""The pytest plugin's --pinstage-simulate: tests written for a GPU run in CPU-only CI."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

USER_TESTS = textwrap.dedent('''
    import pytest, torch

    requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

    @requires_cuda
    def test_gpu_code():
        x = torch.arange(4, device="cuda")
        assert (x * 2).tolist() == [0, 2, 4, 6]

    @requires_cuda
    def test_racy_upload():
        buf = torch.zeros(4, dtype=torch.int64, pin_memory=True)
        dst = torch.empty(4, dtype=torch.int64, device="cuda")
        buf[:] = 1
        dst.copy_(buf, non_blocking=True)
        buf[:] = 2  # rewrites the pinned source before the queued copy read it
        assert dst.sum().item() in (4, 8)

    def test_fixture(simulated_cuda):
        assert torch.cuda.is_available() and simulated_cuda.device.type == "cuda"
''')


def _pytest(*args: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def test_without_the_flag_gpu_tests_skip(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    proc = _pytest("test_user.py", cwd=tmp_path)
    assert proc.returncode == 0 and "1 passed, 2 skipped" in proc.stdout, proc.stdout


def test_with_the_flag_gpu_tests_run_and_the_race_fails(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    # (eager too: the host's write to pinned memory a queued copy reads is a race, whether
    # or not that copy has run already)
    for flag in (["--pinstage-simulate"], ["--pinstage-simulate=lazy"],
                 ["--pinstage-simulate=eager"]):
        proc = _pytest(*flag, "test_user.py", cwd=tmp_path)
        assert proc.returncode == 1, proc.stdout
        assert "HazardError" in proc.stdout and "test_racy_upload" in proc.stdout
        assert "2 passed" in proc.stdout, proc.stdout


def test_a_bad_mode_is_one_clear_error(tmp_path):
    (tmp_path / "test_user.py").write_text(USER_TESTS)
    proc = _pytest("--pinstage-simulate=-x", "test_user.py", cwd=tmp_path)
    assert proc.returncode != 0 and "MODE must be one of" in proc.stderr


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["lazy", "random"])
def test_this_projects_gpu_tests_pass_on_the_simulated_cuda(mode):
    """tests/test_gpu.py, written for a real GPU, runs unmodified in CPU-only CI."""
    proc = _pytest(f"--pinstage-simulate={mode}", "--pinstage-seed", "1", "tests/test_gpu.py",
                   cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]


TWO_FILES = {
    "test_a.py": "def test_a():\n    assert True\n",
    "test_b.py": "def test_b():\n    assert True\n",
}


@pytest.mark.parametrize("flag", [["--pinstage-simulate=lazzy"], ["--pinstage-simulate", "lazzy"]])
def test_an_unknown_mode_is_a_usage_error_naming_the_modes(tmp_path, flag):
    """A misspelt mode used to be accepted silently and run lazy (or all of the tests)."""
    for name, text in TWO_FILES.items():
        (tmp_path / name).write_text(text)
    proc = _pytest(*flag, cwd=tmp_path)
    assert proc.returncode == 4, proc.stdout + proc.stderr  # pytest's usage-error status
    assert "passed" not in proc.stdout
    assert "unknown mode 'lazzy'" in proc.stderr and "eager, lazy, random" in proc.stderr


def test_a_test_path_after_the_bare_flag_is_not_swallowed(tmp_path):
    """`pytest --pinstage-simulate test_a.py` runs test_a.py only, simulated (lazy)."""
    for name, text in TWO_FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "test_a.py").write_text(
        "import torch\n\ndef test_a():\n    assert torch.cuda.is_available()\n")
    proc = _pytest("--pinstage-simulate", "test_a.py", "-rA", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASSED test_a.py::test_a" in proc.stdout and "test_b" not in proc.stdout
    assert "1 passed" in proc.stdout
    # a node id and a directory are paths too; with a second path both run
    proc = _pytest("--pinstage-simulate", "test_a.py::test_a", "test_b.py", cwd=tmp_path)
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "test_c.py").write_text("def test_c():\n    pass\n")
    proc = _pytest("--pinstage-simulate", "sub", cwd=tmp_path)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout


def test_a_mode_after_the_bare_flag_is_a_mode(tmp_path):
    (tmp_path / "test_m.py").write_text(
        "from pinstage import _sim\n\ndef test_m():\n    assert _sim.current().mode == 'eager'\n")
    proc = _pytest("--pinstage-simulate", "eager", "test_m.py", cwd=tmp_path)
    assert proc.returncode == 0 and "1 passed" in proc.stdout, proc.stdout + proc.stderr


def test_pinstage_devices_gives_the_simulated_cuda_that_many_devices(tmp_path):
    (tmp_path / "test_two.py").write_text(
        "import torch\n"
        "def test_two():\n"
        "    assert torch.cuda.device_count() == 2\n"
        "    x = torch.ones(2, device='cuda:1')\n"
        "    assert x.device == torch.device('cuda', 1) and x.cpu().tolist() == [1.0, 1.0]\n")
    run = _pytest("--pinstage-simulate=eager", "--pinstage-devices", "2", "test_two.py",
                  cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout
    bad = _pytest("--pinstage-simulate", "--pinstage-devices", "0", "test_two.py", cwd=tmp_path)
    assert bad.returncode != 0 and "--pinstage-devices must be an int >= 1" in bad.stderr
