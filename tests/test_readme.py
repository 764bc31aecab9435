"""Every README code block meant to run does run (blocks starting with ``# (sketch`` are
illustrations of user code and are skipped); the set-up commands are the CI's."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
BLOCKS = re.findall(r"```python\n(.*?)```", README, flags=re.S)
RUNNABLE = [b for b in BLOCKS if not b.lstrip().startswith("# (sketch")]


def test_readme_has_runnable_blocks():
    assert len(RUNNABLE) >= 2


@pytest.mark.parametrize("code", RUNNABLE, ids=[f"block{i}" for i in range(len(RUNNABLE))])
def test_readme_block_runs_as_printed(code, tmp_path):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for expected in re.findall(r"print\(.*\)\s+# (\[.*\])", code):
        assert expected in proc.stdout, (expected, proc.stdout)


def test_readme_commands_are_the_ci_commands():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", README, flags=re.S) if "pytest" in b]
    assert blocks, "no bash block with the test command"
    test_cmd = [ln for ln in blocks[0].splitlines() if "-m pytest" in ln
                and not ln.lstrip().startswith("#")][0].strip()
    assert test_cmd in ci
    assert "torch==2.13.0" in blocks[0]
    install = re.findall(r"```bash\n(.*?)```", README, flags=re.S)[0]
    # a user's install puts the CPU torch first, never a bare torch that pulls a CUDA build
    assert install.index("torch==2.13.0") < install.index("pip install pinstage")


def test_readme_unordered_streams_raise_a_race():
    """The comment in the first block is true: without the event, the read is a race."""
    code = RUNNABLE[0].replace("torch.cuda.current_stream().wait_event(ready)", "pass")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode != 0 and "HazardError: stream race (read-after-write)" in \
        proc.stderr, proc.stderr
