"""pinstage doctor / bench / audit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pinstage import cli


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pinstage", *args], capture_output=True,
                          text=True, timeout=300)


def test_doctor_prints_capabilities_and_advice():
    proc = run("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "target:" in proc.stdout and "why:" in proc.stdout and "advice:" in proc.stdout


def test_doctor_json():
    proc = run("doctor", "--json")
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    caps = data["capabilities"]
    assert set(caps) >= {"device", "accelerator", "can_pin", "pin_memory", "uva", "reasons"}
    assert isinstance(caps["reasons"], list) and caps["reasons"]
    assert isinstance(data["advice"], list) and data["advice"]


def test_bench_quick_writes_json_and_png(tmp_path):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "b.json", tmp_path / "b.png"
    proc = run("bench", "--quick", "--json", str(js), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(js.read_text())
    assert isinstance(data["target"], str)
    names = {c["name"] for c in data["cases"]}
    assert {"list_upload_256", "ndarray_upload_4k", "noncontig_upload", "staged_writes_256x16",
            "engine_step_256", "cpugpubuffer_round_trip", "h2d_many_8"} <= names
    for c in data["cases"]:
        assert c["pinstage_us"] > 0 and c["baseline_us"] > 0
        assert c["speedup"] == pytest.approx(c["baseline_us"] / c["pinstage_us"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "speedup" in proc.stdout  # the table
    assert data["simulator"]["h2d_many_8_transfers"] == 1


def test_bench_plot_without_extra_says_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "_have", lambda module: module != "matplotlib")
    code = cli.main(["bench", "--quick", "--plot", str(tmp_path / "x.png")])
    assert code != 0
    assert "pinstage[bench]" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_bench_plain_progress_without_rich(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli, "_have", lambda module: module != "rich")
    code = cli.main(["bench", "--quick", "--case", "list_upload_256", "--json",
                     str(tmp_path / "b.json")])
    assert code == 0
    assert "[0/1] list_upload_256" in capsys.readouterr().err
    assert json.loads((tmp_path / "b.json").read_text())["cases"][0]["name"] == "list_upload_256"


def test_audit_command(tmp_path):
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        d = torch.empty(3, device="meta")
        for _ in range(3):
            d.copy_(torch.ones(3))
        print("ran with", sys.argv[1:])
    """))
    proc = run("audit", "--", "python", str(script), "x")
    assert proc.returncode == 0, proc.stderr
    assert "ran with ['x']" in proc.stdout
    assert "3x" in proc.stderr and "blocking-h2d" in proc.stderr and "engine.py:5" in proc.stderr
    strict = run("audit", "--strict", "--", "python", str(script))
    assert strict.returncode == 1
    clean = tmp_path / "clean.py"
    clean.write_text("import torch\ntorch.ones(2).sum()\n")
    assert run("audit", "--strict", "--", "python", str(clean)).returncode == 0


def test_doctor_advice_covers_platforms(monkeypatch):
    import pinstage
    from pinstage import _platform

    monkeypatch.setattr(_platform, "wsl_info",
                        lambda: _platform.WslInfo("5.15.1-microsoft-standard-WSL2", (5, 15, 1)))
    monkeypatch.setattr(_platform, "in_container", lambda: True)
    monkeypatch.setattr(_platform, "confidential_vm", lambda: "Intel TDX")
    text = " ".join(cli._advice(pinstage.capabilities("cpu")))
    assert "WSL" in text and "Container" in text and "Intel TDX" in text
    assert "No accelerator" in text
    from pinstage.testing import simulated_accelerator

    with simulated_accelerator(pin_memory=False):
        text = " ".join(cli._advice(pinstage.capabilities()))
        assert "Pinned staging is off" in text and "UVA is off" in text


@pytest.mark.parametrize("args", [[], ["--simulate"]])
def test_example_engine_step_runs(args):
    import os

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, os.path.join(here, "examples", "engine_step.py"),
                           *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    if args:
        assert "'copies': 10" in proc.stdout and "'host_stalls': 0" in proc.stdout
    else:
        assert "no hidden syncs" in proc.stdout
