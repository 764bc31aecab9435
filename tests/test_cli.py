"""pinstage doctor / bench / audit, and the command line's handling of user mistakes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import pinstage
from pinstage import bench, cli


def run(*args: str, env: dict[str, str] | None = None,
        cwd: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pinstage", *args], capture_output=True,
                          text=True, timeout=300, env=None if env is None else {**os.environ,
                                                                                 **env},
                          cwd=cwd)


def main_in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``cli.main(args)`` as the command runs it (argparse's own exits included)."""
    try:
        code = cli.main(list(args))
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def one_line(err: str) -> str:
    """The single line a user mistake gives (and no traceback)."""
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")


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
    err = capsys.readouterr().err
    # one case and the simulator checks: two steps, counted 1 and 2 of 2 (never 3 of 2)
    assert "[1/2] list_upload_256 ..." in err and "[2/2] simulator checks ..." in err, err
    assert "[0/" not in err and "[3/" not in err
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


# -- user mistakes: one line, exit status 2, before any work ---------------------------------


def test_version():
    proc = run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"pinstage {pinstage.__version__}"


def test_bare_command_prints_usage_and_exits_2():
    proc = run()
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "usage: pinstage" in proc.stderr and "doctor" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "pinstage: error: no command given; choose one of doctor, bench, audit (e.g. "
        "pinstage doctor)")
    assert "required" not in proc.stderr


def test_bench_unknown_case_names_the_valid_ones():
    proc = run("bench", "--case", "bogus")
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert line.startswith("pinstage bench: error: unknown case 'bogus'; valid cases: ")
    assert all(name in line for name in bench.case_names())
    assert proc.stdout == ""  # nothing ran


@no_cuda
@pytest.mark.parametrize("cmd", ["bench", "doctor"])
def test_cuda_device_without_cuda_is_diagnosed(cmd):
    proc = run(cmd, "--device", "cuda")
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert line.startswith(f"pinstage {cmd}: error: device 'cuda' is not available: ")
    if torch.version.cuda is None:
        assert "this torch build has no CUDA (CPU-only" in line
    assert proc.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["bench", "--device", "foo"], "device 'foo' is not a torch device"),
    (["bench", "--device", "meta"], "device 'meta' cannot be benchmarked"),
    (["doctor", "--device", "foo"], "device 'foo' is not a torch device"),
    (["bench", "--json", "/nonexistent-pinstage-dir/b.json"],
     "--json '/nonexistent-pinstage-dir/b.json' cannot be written: the directory"),
    (["bench", "--plot", "/nonexistent-pinstage-dir/b.png"],
     "--plot '/nonexistent-pinstage-dir/b.png' cannot be written: the directory"),
    (["bench", "--case", "list_upload_256", "--case", "nope"], "unknown case 'nope'"),
    (["bench", "--bogus-flag"], "unrecognized arguments: --bogus-flag"),
])
def test_bench_and_doctor_mistakes_in_process(capsys, args, message):
    code, out, err = main_in_process(capsys, *args)
    assert code == 2
    assert message in one_line(err)
    assert out == ""


def test_output_path_under_a_file_or_a_directory(capsys, tmp_path):
    afile = tmp_path / "file.txt"
    afile.write_text("x")
    code, out, err = main_in_process(capsys, "bench", "--json", str(afile / "b.json"))
    assert code == 2 and "is not a directory" in one_line(err) and out == ""
    code, out, err = main_in_process(capsys, "bench", "--json", str(tmp_path))
    assert code == 2 and "is a directory" in one_line(err) and out == ""
    assert sorted(os.listdir(tmp_path)) == ["file.txt"]  # the write check leaves nothing


def test_unwritable_output_dir(capsys, tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli.tempfile, "mkstemp", refuse)  # root may write anywhere
    code, out, err = main_in_process(capsys, "bench", "--json", str(tmp_path / "b.json"))
    assert code == 2 and out == ""
    assert one_line(err).endswith("cannot be written: Permission denied")


def test_plot_format_checked_before_running(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    code, out, err = main_in_process(capsys, "bench", "--plot", str(tmp_path / "b.foo"))
    assert code == 2 and out == ""
    assert "matplotlib cannot write .foo files; use one of" in one_line(err)


def test_bad_environment_setting_is_one_line():
    proc = run("doctor", env={"PINSTAGE_PIN_MEMORY": "maybe"})
    assert proc.returncode == 2
    assert "PINSTAGE_PIN_MEMORY='maybe' is not a valid setting" in one_line(proc.stderr)


# -- bench: interrupts ----------------------------------------------------------------------


def test_bench_interrupt_keeps_finished_cases(monkeypatch, capsys, tmp_path):
    first = next(c for c in bench.CASES if c.name == "list_upload_256")

    def interrupted(device):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "CASES", [first, bench.Case("explodes", "Ctrl-C", interrupted)])
    path = tmp_path / "b.json"
    code, out, err = main_in_process(capsys, "bench", "--quick", "--json", str(path))
    assert code == 130
    assert "Traceback" not in err and "interrupted" in err
    assert "list_upload_256" in out  # the partial table
    data = json.loads(path.read_text())
    assert data["interrupted"] is True
    assert [c["name"] for c in data["cases"]] == ["list_upload_256"]
    assert data["simulator"] is None


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_bench_sigint_in_a_subprocess(tmp_path):
    path = tmp_path / "b.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pinstage", "bench", "--case", "list_upload_256",
         "--case", "staged_writes_256x16", "--case", "engine_step_256", "--json", str(path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        seen = []
        for line in proc.stderr:  # plain progress lines: stderr is not a terminal
            seen.append(line)
            if line.startswith("[2/4]"):  # the first case has finished
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    err = "".join(seen) + err
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    data = json.loads(path.read_text())
    assert data["interrupted"] is True
    assert data["cases"] and data["cases"][0]["name"] == "list_upload_256"
    assert "list_upload_256" in out


# -- audit --------------------------------------------------------------------------------------


SYNCING = textwrap.dedent("""
    import sys, torch
    torch.empty(3, device="meta").copy_(torch.ones(3))
    print("argv", sys.argv)
""")


def test_audit_dash_c_like_python():
    code = SYNCING + "raise SystemExit(7)\n"
    proc = run("audit", "--", "python", "-c", code, "a", "b")
    assert proc.returncode == 7
    assert "argv ['-c', 'a', 'b']" in proc.stdout
    assert "blocking-h2d" in proc.stderr and "<string>:3" in proc.stderr


def test_audit_dash_m_without_python_or_dashes(tmp_path):
    (tmp_path / "engine_mod.py").write_text(SYNCING)
    proc = run("audit", "-m", "engine_mod", "x", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"argv [{str(tmp_path / 'engine_mod.py')!r}, 'x']" in proc.stdout
    assert "blocking-h2d" in proc.stderr


def test_audit_script_that_raises_keeps_the_report(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(SYNCING + "def f():\n    raise ValueError('boom')\nf()\n")
    proc = run("audit", "--strict", str(script))
    assert proc.returncode == 1  # the script's status: an uncaught exception
    err = proc.stderr
    assert err.index("Traceback (most recent call last):") < err.index("ValueError: boom")
    assert "cli.py" not in err and "runpy" not in err  # the program's traceback, as Python's
    assert err.index("ValueError: boom") < err.index("pinstage audit: 1 hidden sync")
    assert "crash.py:3" in err


def test_audit_exit_status_of_system_exit_with_a_message():
    # (SystemExit(7) from the program: test_audit_dash_c_like_python)
    proc = run("audit", "--strict", "-c", "import sys; sys.exit('bye')")
    assert proc.returncode == 1 and "bye" in proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--", "python", "missing_script.py"], "can't open file 'missing_script.py'"),
    (["-m", "no_such_module_pinstage"], "no module named 'no_such_module_pinstage'"),
    (["-c"], "python -c needs an argument"),
    ([], "no program given; usage: pinstage audit"),
    (["--", "python", "-O", "x.py"], "python option '-O' is not supported"),
    (["--", "python", os.path.dirname(os.path.abspath(__file__))], "can't find '__main__.py'"),
    (["--bogus", "x.py"], "unrecognized arguments: --bogus"),
])
def test_audit_mistakes(capsys, args, message):
    code, out, err = main_in_process(capsys, "audit", *args)
    assert code == 2 and out == ""
    line = one_line(err)
    assert line.startswith("pinstage") and ": error: " in line and message in line


def test_audit_missing_script_in_a_subprocess():
    proc = run("audit", "--strict", "--", "python", "missing_script.py", "arg")
    assert proc.returncode == 2
    assert one_line(proc.stderr) == ("pinstage audit: error: can't open file "
                                     "'missing_script.py': no such file or directory")


def test_audit_parse_program():
    assert cli.parse_program(["--", "python3", "-c", "pass", "x"]) == ("-c", "pass", ["-c", "x"])
    assert cli.parse_program(["-cpass"]) == ("-c", "pass", ["-c"])
    assert cli.parse_program([sys.executable, "-m", "mod", "a"]) == ("-m", "mod", ["mod", "a"])
    assert cli.parse_program(["-mmod"]) == ("-m", "mod", ["mod"])


def test_bench_shows_fallback_warnings_and_restores_logging(monkeypatch, capsys):
    import logging

    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # an unconfigured program
    log = logging.getLogger("pinstage")
    before = list(log.handlers)
    with cli._warnings_to_stderr():
        log.warning("pinned staging is off")
    assert capsys.readouterr().err == "pinstage: warning: pinned staging is off\n"
    assert log.handlers == before and log.propagate


def test_doctor_shows_the_staging_limit_in_force(monkeypatch, capsys):
    """The limit is read when a device's staging state is first used; a later change of the
    variable does not change it, and doctor shows the one in force."""
    from pinstage.testing import simulated_accelerator

    monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "8MiB")
    with simulated_accelerator():
        assert cli.main(["doctor", "--no-probe"]) == 0
        monkeypatch.setenv("PINSTAGE_STAGING_LIMIT", "64MiB")
        assert cli.main(["doctor", "--no-probe"]) == 0
    out = capsys.readouterr().out
    assert out.count("staging cap:     8 MiB") == 2 and "64 MiB" not in out


# -- issue 16: what a new user hit ------------------------------------------------------------


@pytest.mark.parametrize("value", ["abc", "1"])
@pytest.mark.parametrize("command", [["doctor"], ["bench", "--quick", "--case",
                                                  "list_upload_256"]])
def test_bad_staging_limit_is_one_line_before_any_work(command, value, tmp_path):
    """docs/command-line.md: an invalid PINSTAGE_* setting is one line, exit 2, before any
    work (bench used to run a case, then print a traceback; doctor said nothing)."""
    js = tmp_path / "b.json"
    extra = ["--json", str(js)] if command[0] == "bench" else []
    proc = run(*command, *extra, env={"PINSTAGE_STAGING_LIMIT": value})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    line = one_line(proc.stderr)
    assert line.startswith(f"pinstage {command[0]}: error: PINSTAGE_STAGING_LIMIT")
    assert repr(value) in line
    assert proc.stdout == "" and not js.exists()  # no case ran, nothing written


@pytest.mark.parametrize("name,value", [("PINSTAGE_UVA", "yes"),
                                        ("PINSTAGE_LOG_LEVEL", "loud")])
def test_every_bad_setting_is_one_line(name, value):
    proc = run("doctor", env={name: value})
    assert proc.returncode == 2
    line = one_line(proc.stderr)
    assert f"{name}={value!r} is not a valid setting" in line


def test_audit_refuses_a_bad_setting_before_running_the_program(tmp_path):
    script = tmp_path / "p.py"
    marker = tmp_path / "ran"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    proc = run("audit", "--", "python", str(script), env={"PINSTAGE_STAGING_LIMIT": "lots"})
    assert proc.returncode == 2 and not marker.exists()
    assert "PINSTAGE_STAGING_LIMIT" in one_line(proc.stderr)


def test_doctor_columns_are_aligned():
    proc = run("doctor", "--no-probe")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    fields = lines[1:lines.index("why:")]
    assert len(fields) >= 6, fields
    starts = set()
    for ln in fields:
        key, rest = ln.split(":", 1)
        starts.add(len(ln) - len(rest.lstrip()))
    assert len(starts) == 1, fields  # every value begins in one column
    keys = [ln.split(":", 1)[0] for ln in fields]
    assert {"target", "pinned memory", "UVA", "container", "WSL", "memlock limit"} <= set(keys)


def test_doctor_json_has_schema_and_facts_as_fields(monkeypatch, capsys):
    from pinstage import _platform

    monkeypatch.setattr(_platform, "wsl_info",
                        lambda: _platform.WslInfo("5.15.1-microsoft-standard-WSL2", (5, 15, 1)))
    monkeypatch.setattr(_platform, "in_container", lambda: True)
    monkeypatch.setattr(cli, "memlock_limit", lambda: 64 << 10)
    assert cli.main(["doctor", "--json", "--no-probe"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert isinstance(data["schema"], int) and data["schema"] >= 1
    assert "staging_limit" not in data  # once, in capabilities
    assert "staging_limit" in data["capabilities"]
    facts = data["platform"]
    assert facts["container"] is True
    assert facts["wsl"] == {"release": "5.15.1-microsoft-standard-WSL2", "kernel": "5.15.1",
                            "pinning_works": True}
    assert facts["memlock_limit_bytes"] == 64 << 10
    assert "confidential_vm" in facts
    assert data["pinstage"] == pinstage.__version__ and data["torch"] == torch.__version__


def test_memlock_limit_is_the_soft_rlimit():
    resource = pytest.importorskip("resource")
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    expected = None if soft == resource.RLIM_INFINITY else soft
    assert cli.memlock_limit() == expected


def test_bench_json_dash_is_stdout(tmp_path):
    proc = run("bench", "--quick", "--case", "list_upload_256", "--json", "-", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)  # stdout holds the JSON alone
    assert data["schema"] >= 1 and data["cases"][0]["name"] == "list_upload_256"
    assert not (tmp_path / "-").exists()
    assert "speedup" in proc.stderr and "wrote -" not in proc.stderr + proc.stdout


def test_bench_json_file_has_schema_and_date(tmp_path):
    js = tmp_path / "b.json"
    proc = run("bench", "--quick", "--case", "list_upload_256", "--json", str(js))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(js.read_text())
    assert data["schema"] == bench.SCHEMA
    import datetime

    assert datetime.datetime.fromisoformat(data["date"]).tzinfo is not None


def test_plot_help_says_png_or_svg_and_svg_is_written(tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "PNG or SVG by the file's extension" in help_text
    assert "'-': to stdout" in help_text
    pytest.importorskip("matplotlib")
    svg = tmp_path / "b.svg"
    assert cli.main(["bench", "--quick", "--case", "list_upload_256", "--plot", str(svg)]) == 0
    text = svg.read_text()
    assert text.lstrip().startswith("<?xml") and "<svg" in text


@pytest.mark.timeout(120)
def test_bench_quick_takes_seconds():
    import time

    t0 = time.perf_counter()
    proc = run("bench", "--quick")
    took = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr
    assert took < 20, took  # a few seconds on the CI machine kind (full: more rounds)


def test_progress_counts_each_step_once_and_is_done_only_at_the_end():
    calls = []
    bench.run_suite(quick=True, device="cpu", only=["list_upload_256", "h2d_many_8"],
                    progress=lambda i, n, name: calls.append((i, n, name)))
    assert calls == [(0, 3, "list_upload_256"), (1, 3, "h2d_many_8"),
                     (2, 3, "simulator checks"), (3, 3, "done")]


def test_rich_bar_is_full_only_when_every_step_is_done(monkeypatch):
    pytest.importorskip("rich")
    import rich.progress

    seen = []
    real_update = rich.progress.Progress.update

    def update(self, task, **kw):
        seen.append((kw.get("completed"), kw.get("total"), kw.get("description")))
        return real_update(self, task, **kw)

    monkeypatch.setattr(rich.progress.Progress, "update", update)
    monkeypatch.setattr(cli.sys.stderr, "isatty", lambda: True, raising=False)
    cb, close = cli._progress_printer()
    try:
        bench.run_suite(quick=True, device="cpu", only=["list_upload_256"], progress=cb)
    finally:
        close()
    assert seen[-1][:2] == (2, 2)
    assert all(c < t for c, t, _ in seen[:-1]), seen  # not full while work remains


def test_table_chart_and_goals_print_a_number_the_same_way():
    report = bench.run_suite(quick=True, device="cpu", only=["stage_write_call"])
    case = report["cases"][0]
    shown = bench.format_value(case["speedup"], "x")
    assert shown in cli.format_table(report)
    goal = report["goals"]["stage_write_call_le_2x_struct_pack"]
    assert goal["value"] == pytest.approx(case["speedup"], abs=1e-4)
    assert f"stage_write_call_le_2x_struct_pack: {shown} " in cli.format_goals(report["goals"])
    assert bench.format_value(1.25, "x") == "1.25x"
    assert bench.format_value(3.44, "us") == "3.4 us"
    assert bench.format_value(0, "") == "0"


def test_chart_has_error_bars_and_a_caption(tmp_path):
    pytest.importorskip("matplotlib")
    report = bench.run_suite(quick=True, device="cpu", only=["list_upload_256", "h2d_many_8"])
    caption = cli.plot_caption(report)
    assert f"pinstage {pinstage.__version__}" in caption and f"torch {torch.__version__}" in caption
    assert report["date"] in caption and report["target"] in caption
    assert "interquartile range" in caption
    c = report["cases"][0]
    assert c["pinstage_q1_us"] <= c["pinstage_us"] <= c["pinstage_q3_us"]
    lo, hi = cli._errors(report["cases"], "pinstage")
    assert lo[0] == pytest.approx(c["pinstage_us"] - c["pinstage_q1_us"])
    assert hi[0] == pytest.approx(c["pinstage_q3_us"] - c["pinstage_us"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    captured = {}
    real_savefig = plt.Figure.savefig

    def keep(self, *a, **k):
        captured["texts"] = [t.get_text() for t in self.texts]
        captured["errorbars"] = sum(getattr(c, "errorbar", None) is not None
                                    for ax in self.axes for c in ax.containers)
        return real_savefig(self, *a, **k)

    plt.Figure.savefig = keep
    try:
        cli.write_plot(report, str(tmp_path / "c.png"))
    finally:
        plt.Figure.savefig = real_savefig
    assert caption in captured["texts"]
    assert captured["errorbars"] == 3  # both sides' bars and the speedup's


def test_a_mistyped_flag_is_an_error_not_an_abbreviation(capsys):
    """Issue 20 item 12: ``audit --stric`` ran the program as if --strict were given."""
    from pinstage.cli import main

    for argv in (["audit", "--stric", "--", "python", "-c", "print(1)"], ["bench", "--qui"]):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2
        assert f"unrecognized arguments: {argv[1]}" in capsys.readouterr().err


def test_bench_json_to_an_empty_path_is_a_usage_error(capsys):
    from pinstage.cli import main

    assert main(["bench", "--quick", "--json", ""]) == 2
    assert "--json '': give a file path" in capsys.readouterr().err
