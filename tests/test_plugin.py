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
    for flag in (["--pinstage-simulate"], ["--pinstage-simulate=lazy"]):
        proc = _pytest(*flag, "test_user.py", cwd=tmp_path)
        assert proc.returncode == 1, proc.stdout
        assert "HazardError" in proc.stdout and "test_racy_upload" in proc.stdout
        assert "2 passed" in proc.stdout, proc.stdout
    proc = _pytest("--pinstage-simulate=eager", "test_user.py", cwd=tmp_path)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, proc.stdout  # eager: in order


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
