"""Threads and the simulated CUDA's lifetime (issue 20, item 11)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

_PROGRAM = textwrap.dedent("""
    import threading, torch
    from pinstage.testing import simulated_accelerator
    with simulated_accelerator("lazy"):
        def work():
            x = torch.ones(64, device="cuda") * 2 + 1
            assert x.sum().item() == 192.0
        threads = [threading.Thread(target=work) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        threading.Thread(target=lambda: None).start()  # one that does nothing, not joined
    print("done")
""")


@pytest.mark.timeout(300)
def test_threads_started_inside_the_simulator_leave_a_clean_exit():
    """Threads started while the simulator is open enter its modes; they leave them when they
    end. Before, the modes stayed in torch's thread-local state, freed by C++ after Python let
    go, and the process aborted at exit ('terminate called without an active exception', exit
    134) in about 7 runs out of 10."""
    for _ in range(4):
        run = subprocess.run([sys.executable, "-c", _PROGRAM], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr[-2000:]
        assert run.stdout.strip() == "done"
        assert "terminate called" not in run.stderr


@pytest.mark.timeout(120)
def test_a_thread_that_outlives_the_simulator_gets_a_pinstage_error():
    """Not torch's 'Torch not compiled with CUDA enabled' for a tensor of a closed session."""
    code = textwrap.dedent("""
        import threading, torch
        from pinstage.testing import simulated_accelerator
        go, started, out = threading.Event(), threading.Event(), []
        def work():
            x = torch.ones(2, device="cuda")
            started.set()
            go.wait()
            try:
                x + 1
                out.append("no error")
            except RuntimeError as exc:
                out.append(str(exc))
        with simulated_accelerator("lazy"):
            t = threading.Thread(target=work)
            t.start()
            started.wait(60)
        go.set()
        t.join()
        print(out[0])
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=100)
    assert run.returncode == 0, run.stderr[-2000:]
    said = run.stdout.strip()  # it works on the final values, or pinstage says why not
    assert said == "no error" or "simulat" in said, said
