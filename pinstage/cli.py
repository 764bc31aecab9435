"""The ``pinstage`` command: ``doctor``, ``bench`` and ``audit``.

A user mistake (unknown case or device, unwritable output path, missing script, a bad
environment setting) gives one line on stderr and exit status 2, never a traceback; Ctrl-C
gives exit status 130.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import json
import logging
import os
import re
import runpy
import sys
import tempfile
import traceback
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from ._version import __version__

__all__ = ["UsageError", "device_problem", "main"]

BENCH_EXTRA_HINT = "install the bench extra: pip install 'pinstage[bench]'"
AUDIT_USAGE = "pinstage audit [--strict] -- python (SCRIPT | -c CODE | -m MODULE) [ARGS...]"


class UsageError(Exception):
    """A mistake on the command line: reported as one line, exit status 2."""


# -- checks shared by the commands ----------------------------------------------------------


def device_problem(spec: str) -> str | None:
    """Why ``spec`` cannot be a target on this machine, as one diagnosis (None: it can)."""
    import torch

    try:
        dev = torch.device(spec)
    except (RuntimeError, ValueError, TypeError):
        return (f"device {spec!r} is not a torch device: expected cpu, cuda, cuda:N or another "
                "torch device type (xpu, mps, ...)")
    if dev.type == "cuda":
        hip = getattr(torch.version, "hip", None)
        built = torch.version.cuda or hip
        if not built:
            return (f"device {spec!r} is not available: this torch build has no CUDA (CPU-only "
                    f"torch {torch.__version__}); install a CUDA or ROCm build of torch")
        if not torch.cuda.is_available():
            return (f"device {spec!r} is not available: torch {torch.__version__} was built "
                    f"for {'ROCm' if hip else 'CUDA'} {built} but sees no GPU (check the "
                    "driver, e.g. nvidia-smi, and CUDA_VISIBLE_DEVICES)")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            return (f"device {spec!r} is not available: this machine has {n} CUDA device(s) "
                    f"(cuda:0 to cuda:{n - 1})")
    return None


def check_environment() -> None:
    """Raise ``UsageError`` naming the first invalid ``PINSTAGE_*`` setting (read here, before
    any work, so a bad value is one line and exit status 2, not a failure halfway through)."""
    from ._arena import staging_limit
    from ._capabilities import check_policies
    from ._logging import level_from_env

    try:
        check_policies()
        staging_limit()
        level_from_env()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _check_device(spec: str | None) -> None:
    if spec is None:
        return
    problem = device_problem(spec)
    if problem is not None:
        raise UsageError(problem)


def _check_output(path: str, flag: str) -> None:
    """Raise ``UsageError`` unless ``path`` can be written (checked before any work)."""
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    if os.path.isdir(full):
        raise UsageError(f"{flag} {path!r} is a directory; give a file path")
    if not os.path.exists(parent):
        raise UsageError(f"{flag} {path!r} cannot be written: the directory {parent!r} does "
                         "not exist")
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {path!r} cannot be written: {parent!r} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(dir=parent, prefix=".pinstage-write-check-")
        os.close(fd)
        os.unlink(probe)
        if os.path.exists(full) and not os.access(full, os.W_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as exc:
        raise UsageError(f"{flag} {path!r} cannot be written: {exc.strerror or exc}") from None


def _check_plot_format(path: str) -> None:
    ext = os.path.splitext(path)[1][1:].lower()
    if not ext:
        return  # matplotlib writes its default format (PNG)
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    if ext not in formats:
        raise UsageError(f"--plot {path!r}: matplotlib cannot write .{ext} files; use one of "
                         + ", ".join(f".{f}" for f in sorted(formats)))


@contextmanager
def _quiet_pinstage_log() -> Iterator[None]:
    """Drop the ``pinstage`` logger's fallback warnings (``doctor`` reports the same)."""
    log = logging.getLogger("pinstage")

    def drop(record: logging.LogRecord) -> bool:
        return False

    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)


@contextmanager
def _warnings_to_stderr() -> Iterator[None]:
    """Show the ``pinstage`` logger's warnings as ``pinstage: warning: ...`` lines while the
    command runs, unless logging is configured already."""
    from ._logging import configured

    log = logging.getLogger("pinstage")
    if configured():  # the NullHandler alone is not a configuration
        yield
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("pinstage: warning: %(message)s"))
    log.addHandler(handler)
    propagate, log.propagate = log.propagate, False
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.propagate = propagate


# -- doctor -----------------------------------------------------------------------------------


def _advice(caps: Any) -> list[str]:
    from ._platform import confidential_vm, in_container, wsl_info

    tips: list[str] = []
    wsl = wsl_info()
    if not caps.accelerator:
        tips.append("No accelerator is visible: pinstage runs on the CPU target (plain host "
                    "copies, everything finished on return). For a GPU, install a CUDA or ROCm "
                    "build of torch and check that the driver sees the device.")
    else:
        if caps.pin_memory:
            tips.append("Pinned staging is on: uploads from lists, arrays and unpinned tensors "
                        "never make the host wait; keep PINSTAGE_STAGING_LIMIT above your "
                        "largest per-step upload.")
        else:
            tips.append("Pinned staging is off: every upload from host memory blocks the host. "
                        "Find out why in the reasons above; PINSTAGE_PIN_MEMORY=1 fails loudly "
                        "if it is impossible.")
        if not caps.uva:
            tips.append("UVA is off: UvaBufferPool and StagedWriteTensor fall back to device "
                        "memory and one copy per hand-out (still non-blocking when pinned).")
    if wsl is not None:
        tips.append("WSL: Windows caps pinned memory near half of RAM and WSL fails to pin "
                    "beyond ~0.5-1 GiB in total, so keep pinned buffers small; pinstage caps "
                    "its staging arena at 64 MiB here (PINSTAGE_STAGING_LIMIT overrides).")
    if in_container():
        tips.append("Container: pinned memory is locked host RAM charged to this container; "
                    "if pinning fails, raise the container's memory limit and check "
                    f"'ulimit -l' (here: {_size(memlock_limit())}).")
    if caps.accelerator and caps.backend == "cuda":
        import torch

        if getattr(torch.version, "hip", None):
            tips.append("ROCm: UVA views use hipHostGetDevicePointer (registered memory can "
                        "live at another device address); the coherence probe checked them.")
    cc = confidential_vm()
    if cc is not None:
        tips.append(f"Confidential VM ({cc}): with GPU Confidential Computing, host-device "
                    "traffic goes through encrypted bounce buffers; UVA views of pinned memory "
                    "can read garbage, so pinstage trusts UVA only if its coherence probe "
                    "passed (see the reasons above). Expect lower H2D bandwidth.")
    elif caps.accelerator and caps.backend == "cuda":
        tips.append("No confidential-VM guest device is visible; if GPU Confidential Computing "
                    "is on anyway, the UVA coherence probe fails closed and UVA stays off.")
    return tips


def cmd_doctor(args: argparse.Namespace) -> int:
    """``pinstage doctor``: capabilities, reasons and advice (exit status 0)."""
    with _quiet_pinstage_log():
        return _doctor(args)


DOCTOR_SCHEMA = 1  # version of ``doctor --json``'s layout (``schema`` in it)


def memlock_limit() -> int | None:
    """The soft ``RLIMIT_MEMLOCK`` of this process in bytes (``ulimit -l``), None if unlimited
    or unknown: what ``mlock`` may lock here (CUDA's own pinning is not counted against it)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    except (ImportError, AttributeError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else int(soft)


def platform_facts() -> dict[str, Any]:
    """The host facts ``doctor`` bases its advice on, as fields (``--json``: ``platform``)."""
    import platform

    from ._platform import confidential_vm, in_container, wsl_info

    wsl = wsl_info()
    return {
        "os": platform.platform(),
        "python": platform.python_version(),
        "container": in_container(),
        "wsl": None if wsl is None else {"release": wsl.release,
                                         "kernel": ".".join(map(str, wsl.kernel)),
                                         "pinning_works": wsl.pinning_works},
        "confidential_vm": confidential_vm(),
        "memlock_limit_bytes": memlock_limit(),
    }


def _size(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, k in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << k:
            return f"{n / (1 << k):g} {unit}"
    return f"{n} bytes"


def _doctor(args: argparse.Namespace) -> int:
    import pinstage

    _check_device(args.device)
    try:
        caps = pinstage.capabilities(args.device)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    from ._capabilities import staging_limit_in_force

    limit = staging_limit_in_force(caps.device)  # the cap the arena uses, read once per device
    caps = dataclasses.replace(caps, staging_limit=limit)
    import torch

    facts = platform_facts()
    report: dict[str, Any] = {"schema": DOCTOR_SCHEMA, "pinstage": pinstage.__version__,
                              "torch": torch.__version__, "capabilities": caps.as_dict(),
                              "platform": facts, "host_memory": pinstage.host_memory_stats(),
                              "advice": _advice(caps)}
    if caps.accelerator and caps.backend == "cuda" and not args.no_probe:
        from ._cuda import bandwidth_probe

        report["probe"] = bandwidth_probe(caps.device)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    wsl = facts["wsl"]
    rows: list[tuple[str, str]] = [
        ("target", f"{caps.device} ({'accelerator' if caps.accelerator else 'CPU'}, backend "
                   f"{caps.backend})"),
        ("pinned memory", f"{'yes' if caps.pin_memory else 'no'} (can pin: "
                          f"{'yes' if caps.can_pin else 'no'})"),
        ("UVA", "yes" if caps.uva else "no"),
    ]
    if caps.staging_limit:
        rows.append(("staging cap", _size(caps.staging_limit)))
    rows += [
        ("container", "yes" if facts["container"] else "no"),
        ("WSL", "no" if wsl is None else f"yes (kernel {wsl['kernel']})"),
        ("confidential VM", facts["confidential_vm"] or "none seen"),
        ("memlock limit", _size(facts["memlock_limit_bytes"]) + " (ulimit -l)"),
    ]
    if "probe" in report:
        p = report["probe"]
        rows.append(("measured", f"pinned H2D {p['pinned_h2d_gbps']:.1f} GB/s, pageable H2D "
                                 f"{p['pageable_h2d_gbps']:.1f} GB/s, 1 KiB copy "
                                 f"{p['small_copy_host_us']:.1f} us host time"))
    width = max(len(k) for k, _ in rows) + 2
    print(f"pinstage {pinstage.__version__} doctor (torch {torch.__version__})")
    for key, value in rows:
        print(f"{key + ':':<{width}}{value}")
    print("why:")
    for r in caps.reasons:
        print(f"  - {r}")
    print("advice:")
    for t in report["advice"]:
        print(f"  * {t}")
    return 0


# -- bench ------------------------------------------------------------------------------------


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _progress_printer() -> tuple[Callable[[int, int, str], None], Callable[[], None]]:
    """A progress callback and its closer: a rich bar on a terminal (with the bench extra),
    else plain lines; both on stderr, so stdout holds only the results. The callback gets
    (steps done, steps in all, the step starting now): the bar is full only when all are
    done, and the plain lines count ``[1/N]`` to ``[N/N]``."""
    if _have("rich") and sys.stderr.isatty():
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        prog = Progress(TextColumn("[bold]pinstage bench[/]"), BarColumn(),
                        TextColumn("{task.completed}/{task.total} {task.description}"),
                        TimeElapsedColumn(), transient=True, console=Console(stderr=True))
        prog.start()
        task = prog.add_task("", total=1)

        def cb(i: int, n: int, name: str) -> None:
            prog.update(task, total=n, completed=i, description=name)

        return cb, prog.stop

    def plain(i: int, n: int, name: str) -> None:
        if i < n:
            print(f"[{i + 1}/{n}] {name} ...", file=sys.stderr, flush=True)

    return plain, lambda: None


def format_table(report: dict[str, Any]) -> str:
    """The cases as a text table (median +- interquartile range, speedup, host stalls)."""
    from .bench import format_value

    rows = [("case", "pinstage us", "+-", "baseline us", "+-", "speedup", "stalls")]
    for c in report["cases"]:
        rows.append((c["name"], f"{c['pinstage_us']:.1f}", f"{c['pinstage_spread_us']:.1f}",
                     f"{c['baseline_us']:.1f}", f"{c['baseline_spread_us']:.1f}",
                     format_value(c["speedup"], "x"), str(c.get("pinstage_host_stalls", ""))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(v.ljust(widths[i]) if i == 0 else v.rjust(widths[i])
                               for i, v in enumerate(r)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    for sk in report.get("skipped", []):
        lines.append(f"skipped: {sk['name']} ({sk['reason']})")
    return "\n".join(lines)


def format_goals(goals: dict[str, dict[str, Any]]) -> str:
    """One line per goal: status, name, measured value and limit (or why it did not run),
    printed as the table prints the same number (``format_value``)."""
    from .bench import format_value

    lines = []
    for name, g in goals.items():
        if g["status"] == "not run":
            lines.append(f"  not run  {name}: {g['reason']}")
        else:
            unit = g.get("unit", "x")
            lines.append(f"  {g['status']:<7}  {name}: {format_value(g['value'], unit)} (goal "
                         f"{g['compare']} {format_value(g['limit'], unit)})")
    return "\n".join(lines)


def _errors(cases: list[dict[str, Any]], side: str) -> list[list[float]]:
    """Error bars (below, above the median) from the quartiles of ``side`` (``pinstage`` or
    ``baseline``); a report without them: half the spread each way."""
    lo, hi = [], []
    for c in cases:
        med = c[f"{side}_us"]
        if f"{side}_q1_us" in c:
            lo.append(max(med - c[f"{side}_q1_us"], 0.0))
            hi.append(max(c[f"{side}_q3_us"] - med, 0.0))
        else:
            half = c.get(f"{side}_spread_us", 0.0) / 2
            lo.append(min(half, med * 0.999))  # a log axis: never to zero
            hi.append(half)
    return [lo, hi]


def plot_caption(report: dict[str, Any]) -> str:
    """What the chart shows and where it was measured: versions, device and date."""
    cases = report["cases"]
    torch_v = report.get("host", {}).get("torch", "?")
    date = report.get("date") or "date not recorded"
    bars = ("the interquartile range over rounds (speedup: from the quartiles of both sides)"
            if all("pinstage_q1_us" in c for c in cases) else
            "half the interquartile range each way (the report has no quartiles)")
    return (f"pinstage {report.get('pinstage', '?')}, torch {torch_v}, target "
            f"{report['target']} ({report.get('device_name', '')}), {date}. Median of "
            f"{cases[0]['rounds'] if cases else 0} interleaved rounds; error bars: {bars}.")


def write_plot(report: dict[str, Any], path: str) -> None:
    """A chart of the cases: time per call of both sides (log scale, with the spread as error
    bars) and the speedup, labelled as the table prints it. A case whose baseline is a floor
    (part of the work done bare) is grey and labelled so. PNG, SVG or any format matplotlib
    writes, by the extension of ``path``."""
    import matplotlib

    from .bench import format_value

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    names = [c["name"] + (f"\n(baseline: {c['baseline_floor']}, a floor)"
                          if c.get("baseline_floor") else "") for c in cases]
    ours = [c["pinstage_us"] for c in cases]
    base = [c["baseline_us"] for c in cases]
    speed = [c["speedup"] for c in cases]
    y = list(range(len(cases)))[::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.55 * len(cases) + 2.2),
                                   gridspec_kw={"width_ratios": [3, 2]}, sharey=True)
    h = 0.38
    bar_err = {"ecolor": "black", "capsize": 2, "elinewidth": 0.8}
    ax1.barh([v + h / 2 for v in y], base, h, xerr=_errors(cases, "baseline"),
             error_kw=bar_err, label="straightforward PyTorch", color="#9aa5b1")
    ax1.barh([v - h / 2 for v in y], ours, h, xerr=_errors(cases, "pinstage"),
             error_kw=bar_err, label="pinstage", color="#1f77b4")
    ax1.set_xscale("log")
    ax1.set_yticks(y, names)
    ax1.set_xlabel("time per call, microseconds (log scale, lower is better)")
    ax1.legend(loc="lower right", fontsize=8)
    colors = ["#9aa5b1" if c.get("baseline_floor") else "#2ca02c" if s >= 1 else "#d62728"
              for c, s in zip(cases, speed)]
    # the speedup's range: from (baseline q1 / pinstage q3) to (baseline q3 / pinstage q1)
    s_lo, s_hi = [], []
    for c, sp in zip(cases, speed):
        if "pinstage_q1_us" in c and c["pinstage_q1_us"] > 0 and c["pinstage_q3_us"] > 0:
            s_lo.append(max(sp - c["baseline_q1_us"] / c["pinstage_q3_us"], 0.0))
            s_hi.append(max(c["baseline_q3_us"] / c["pinstage_q1_us"] - sp, 0.0))
        else:
            s_lo.append(0.0)
            s_hi.append(0.0)
    ax2.barh(y, speed, 0.6, color=colors, xerr=[s_lo, s_hi], error_kw=bar_err)
    ax2.axvline(1.0, color="black", linewidth=0.8)
    for yy, s, hi, c in zip(y, speed, s_hi, cases):
        label = " " + format_value(s, "x") + (" of the floor" if c.get("baseline_floor") else "")
        ax2.text(s + hi, yy + 0.3, label, va="center", fontsize=8)
    ax2.set_xlabel("speedup = baseline / pinstage (higher is better)")
    ax2.set_xlim(0, max(sp + hi for sp, hi in zip(speed, s_hi)) * 1.3 + 0.1 if speed else 1)
    target = report["target"]
    fig.suptitle(f"pinstage bench on {target} ({report.get('device_name', '')})")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.text(0.01, 0.01, plot_caption(report), fontsize=7, ha="left", va="bottom", wrap=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    """``pinstage bench``: arguments and output paths are checked before anything runs."""
    from . import bench

    if args.plot and not _have("matplotlib"):
        raise UsageError(f"--plot needs matplotlib: {BENCH_EXTRA_HINT}")
    if args.case:
        try:
            bench.check_case_names(args.case)
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    _check_device(args.device)
    to_stdout = args.json == "-"  # the JSON on stdout (as Unix tools read '-'): text to stderr
    if args.plot == "-":
        raise UsageError("--plot '-': give a file path (a chart is not written to stdout)")
    for path, flag in ((None if to_stdout else args.json, "--json"), (args.plot, "--plot")):
        if path == "":
            raise UsageError(f"{flag} '': give a file path" +
                             (" (or '-' for stdout)" if flag == "--json" else ""))
        if path:
            _check_output(path, flag)
    if args.plot:
        _check_plot_format(args.plot)
    try:
        device = bench.resolve_target(args.device)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise UsageError(str(exc)) from None
    cb, close = _progress_printer()
    try:
        with _warnings_to_stderr():
            report = bench.run_suite(quick=args.quick, device=device, progress=cb,
                                     only=args.case or None)
    finally:
        close()
    # the files first: a closed stdout (``pinstage bench | head``) must not lose them
    if args.json and not to_stdout:
        _write(args.json, "--json", lambda: _write_json(report, args.json))
    if args.plot and report["cases"]:
        _write(args.plot, "--plot", lambda: write_plot(report, args.plot))
    text = sys.stderr if to_stdout else sys.stdout

    def say(line: str) -> None:
        print(line, file=text)

    say(f"pinstage bench: target {report['target']} ({report['device_name']}), "
        f"{'quick' if args.quick else 'full'} run")
    say(format_table(report))
    sim = report["simulator"]
    if sim:
        say(f"simulator: h2d_many of 8 arrays = {sim['h2d_many_8_transfers']} transfer(s) "
            f"(8 separate calls: {sim['separate_8_transfers']}); host stalls in 50 "
            f"steady-state engine steps: {sim['steady_state_host_stalls_50_steps']}")
    say("goals:")
    say(format_goals(report["goals"]))
    for path in (None if to_stdout else args.json, args.plot if report["cases"] else None):
        if path:
            say(f"wrote {path}")
    if to_stdout:
        sys.stdout.write(json.dumps(report, indent=2) + "\n")
        sys.stdout.flush()
    if report["interrupted"]:
        print(f"pinstage bench: interrupted; {len(report['cases'])} finished case(s) above"
              + (f" and in {args.json}" if args.json else ""), file=sys.stderr)
    return 130 if report["interrupted"] else 0


def _write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2)


def _write(path: str, flag: str, write: Callable[[], None]) -> None:
    try:
        write()
    except OSError as exc:
        raise UsageError(f"{flag} {path!r} could not be written: {exc.strerror or exc}") from None


# -- audit ------------------------------------------------------------------------------------

_PYTHON = re.compile(r"python(\d+(\.\d+)*)?[mtw]?(\.exe)?")


def _is_python(word: str) -> bool:
    base = os.path.basename(word)
    if _PYTHON.fullmatch(base):
        return True
    try:
        return os.path.samefile(word, sys.executable)
    except OSError:
        return False


def parse_program(command: list[str]) -> tuple[str, str, list[str]]:
    """``[--] [python] (SCRIPT | -c CODE | -m MODULE) [ARGS...]`` -> (kind, target, argv),
    kind ``"script"``, ``"-c"`` or ``"-m"``, argv as Python would set ``sys.argv``."""
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd and _is_python(cmd[0]):
        cmd = cmd[1:]
    if not cmd:
        raise UsageError(f"no program given; usage: {AUDIT_USAGE}")
    first, rest = cmd[0], cmd[1:]
    for flag in ("-c", "-m"):
        if first.startswith(flag):
            target = first[2:]
            if not target:
                if not rest:
                    raise UsageError(f"python {flag} needs an argument "
                                     f"({'the code to run' if flag == '-c' else 'a module'})")
                target, rest = rest[0], rest[1:]
            return flag, target, [flag if flag == "-c" else target, *rest]
    if first.startswith("-") and first != "-":
        raise UsageError(f"python option {first!r} is not supported: pinstage audit runs the "
                         "program in its own process and accepts SCRIPT, -c CODE or -m MODULE")
    if not os.path.exists(first):
        raise UsageError(f"can't open file {first!r}: no such file or directory")
    if os.path.isdir(first) and not os.path.exists(os.path.join(first, "__main__.py")):
        raise UsageError(f"can't find '__main__.py' in the directory {first!r}")
    return "script", first, [first, *rest]


def _check_module(name: str) -> None:
    """Raise ``UsageError`` if ``python -m name`` would find nothing to run (looked up as
    ``python -m`` does, with the current directory first on ``sys.path``)."""
    import importlib.util

    saved = list(sys.path)
    sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            if importlib.util.find_spec(name + ".__main__") is None:
                raise UsageError(f"{name!r} is a package without a __main__ module; it cannot "
                                 "be run with -m")
    except (ImportError, ValueError) as exc:
        raise UsageError(f"no module named {name!r} ({exc})") from None
    finally:
        sys.path[:] = saved
    if spec is None:
        raise UsageError(f"no module named {name!r}")


def _exec_code(code: str) -> None:
    """Run ``code`` as ``python -c`` does: in a fresh ``__main__`` module."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    saved = sys.modules.get("__main__")
    sys.modules["__main__"] = main
    try:
        exec(compile(code, "<string>", "exec"), main.__dict__)
    finally:
        if saved is not None:
            sys.modules["__main__"] = saved


def _exit_status(code: object) -> int:
    """The exit status Python gives ``SystemExit(code)`` (a message is printed, status 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _print_program_traceback(exc: BaseException) -> None:
    """Print ``exc`` as Python would for the program: without pinstage's and runpy's frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_globals.get("__name__") in (__name__, "runpy"):
        tb = tb.tb_next
    exc.__traceback__ = tb  # the standard hook prints the exception's own traceback
    try:
        sys.excepthook(type(exc), exc, tb)
    except Exception:  # a broken hook set by the program: fall back to the standard one
        traceback.print_exception(type(exc), exc, tb)


def run_program(kind: str, target: str, argv: list[str]) -> int:
    """Run the program in this process as ``python`` would; returns its exit status (1 for an
    uncaught exception, whose traceback is printed; 130 for Ctrl-C)."""
    old_argv, old_path = sys.argv, list(sys.path)
    try:
        sys.path.insert(0, os.path.dirname(os.path.abspath(target)) if kind == "script"
                        else "" if kind == "-c" else os.getcwd())
        sys.argv = list(argv)
        try:
            if kind == "-c":
                _exec_code(target)
            elif kind == "-m":
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
        except SystemExit as exc:
            return _exit_status(exc.code)
        except KeyboardInterrupt as exc:
            _print_program_traceback(exc)
            return 130
        except BaseException as exc:  # the program's own error: its output, not ours
            _print_program_traceback(exc)
            return 1
        return 0
    finally:
        sys.argv = old_argv
        sys.path[:] = old_path


def cmd_audit(args: argparse.Namespace) -> int:
    """``pinstage audit``: run a program under ``audit()``; print the report even when it
    fails; exit with its status (``--strict``: 1 if it succeeded but anything was found)."""
    kind, target, argv = parse_program(args.command)
    if kind == "-m":
        _check_module(target)
    import pinstage

    with pinstage.audit() as report:
        status = run_program(kind, target, argv)
    sys.stdout.flush()
    print(report.summary(), file=sys.stderr)
    if args.strict and report.findings and status == 0:
        return 1
    return status


# -- entry ------------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line (``pinstage bench: error: ...``), exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``pinstage`` command."""
    # No abbreviations: a mistyped flag (``audit --stric``) is an error, never taken for
    # another one.
    p = _Parser(prog="pinstage", description="Host-to-device staging for PyTorch without "
                "hidden host stalls.", allow_abbrev=False)
    p.add_argument("--version", action="version", version=f"pinstage {__version__}")
    sub = p.add_subparsers(dest="cmd", metavar="{doctor,bench,audit}")
    d = sub.add_parser("doctor", help="what this machine can do, why, and advice",
                       allow_abbrev=False)
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--device", default=None, help="target device (default: the best one)")
    d.add_argument("--no-probe", action="store_true", help="skip the GPU bandwidth probe")
    d.set_defaults(func=cmd_doctor)
    b = sub.add_parser("bench", help="pinstage vs the straightforward PyTorch way",
                       allow_abbrev=False)
    b.add_argument("--quick", action="store_true", help="fewer rounds (seconds on a CPU)")
    b.add_argument("--json", metavar="PATH",
                   help="write the results as JSON ('-': to stdout, the table then goes to "
                        "stderr)")
    b.add_argument("--plot", metavar="PATH",
                   help="write a chart, PNG or SVG by the file's extension (any format "
                        "matplotlib writes; needs pinstage[bench])")
    b.add_argument("--device", default=None, help="target device (default: the best one)")
    b.add_argument("--case", action="append", metavar="NAME",
                   help="run only this case (repeatable)")
    b.set_defaults(func=cmd_bench)
    a = sub.add_parser("audit", help="run a Python program under the hidden-sync audit",
                       usage=AUDIT_USAGE, allow_abbrev=False)
    a.add_argument("--strict", action="store_true",
                   help="exit 1 if anything was found (and the program succeeded)")
    a.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- python (SCRIPT | -c CODE | -m MODULE) [ARGS...]")
    a.set_defaults(func=cmd_audit)
    return p


def _split_audit(argv: list[str]) -> tuple[list[str], list[str]]:
    """``audit``'s own options and the program's command line (which argparse would mangle:
    ``-c``/``-m`` look like options). Options end at ``--`` or the first other word."""
    opts: list[str] = []
    for i, word in enumerate(argv):
        if word == "--":
            return opts, argv[i:]
        if word in ("--strict", "-h", "--help"):
            opts.append(word)
            continue
        if word.startswith("--"):
            opts.append(word)  # argparse reports it as unknown
            continue
        return opts, argv[i:]
    return opts, []


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    program: list[str] | None = None
    if argv and argv[0] == "audit":
        opts, program = _split_audit(argv[1:])
        argv = ["audit", *opts]
    args = parser.parse_args(argv)
    if args.cmd is None:
        parser.print_help(sys.stderr)
        print("pinstage: error: no command given; choose one of doctor, bench, audit (e.g. "
              "pinstage doctor)", file=sys.stderr)
        return 2
    if program is not None:
        args.command = program
    try:
        check_environment()
        return int(args.func(args))
    except UsageError as exc:
        print(f"pinstage {args.cmd}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"pinstage {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # stdout closed early (``| head``): stop quietly
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
