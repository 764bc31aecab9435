"""The ``pinstage`` command: ``doctor``, ``bench`` and ``audit``."""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from typing import Any

__all__ = ["main"]

BENCH_EXTRA_HINT = "install the bench extra: pip install 'pinstage[bench]'"


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
                    "'ulimit -l'.")
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
    import pinstage

    caps = pinstage.capabilities(args.device)
    report: dict[str, Any] = {"capabilities": caps.as_dict(), "advice": _advice(caps),
                              "staging_limit": caps.staging_limit,
                              "host_memory": pinstage.host_memory_stats()}
    import torch

    report["torch"] = torch.__version__
    report["pinstage"] = pinstage.__version__
    if caps.accelerator and caps.backend == "cuda" and not args.no_probe:
        from ._cuda import bandwidth_probe

        report["probe"] = bandwidth_probe(caps.device)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"pinstage {pinstage.__version__} doctor (torch {torch.__version__})")
    print(f"target:       {caps.device} ({'accelerator' if caps.accelerator else 'CPU'}, "
          f"backend {caps.backend})")
    print(f"pinned memory: {'yes' if caps.pin_memory else 'no'} (can pin: "
          f"{'yes' if caps.can_pin else 'no'})")
    print(f"UVA:          {'yes' if caps.uva else 'no'}")
    if caps.staging_limit:
        print(f"staging cap:  {caps.staging_limit / 2**20:.0f} MiB")
    print("why:")
    for r in caps.reasons:
        print(f"  - {r}")
    if "probe" in report:
        p = report["probe"]
        print(f"measured:     pinned H2D {p['pinned_h2d_gbps']:.1f} GB/s, pageable H2D "
              f"{p['pageable_h2d_gbps']:.1f} GB/s, 1 KiB copy {p['small_copy_host_us']:.1f} us "
              "host time")
    print("advice:")
    for t in report["advice"]:
        print(f"  * {t}")
    return 0


# -- bench ------------------------------------------------------------------------------------


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _progress_printer() -> tuple[Any, Any]:
    """A progress callback (rich if installed, else plain lines on stderr) and a closer."""
    if _have("rich"):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        prog = Progress(TextColumn("[bold]pinstage bench[/]"), BarColumn(),
                        TextColumn("{task.completed}/{task.total} {task.description}"),
                        TimeElapsedColumn(), transient=True)
        prog.start()
        task = prog.add_task("", total=1)

        def cb(i: int, n: int, name: str) -> None:
            prog.update(task, total=n, completed=i, description=name)

        return cb, prog.stop

    def plain(i: int, n: int, name: str) -> None:
        print(f"[{i}/{n}] {name} ...", file=sys.stderr, flush=True)

    return plain, lambda: None


def format_table(report: dict[str, Any]) -> str:
    rows = [("case", "pinstage us", "+-", "baseline us", "+-", "speedup")]
    for c in report["cases"]:
        rows.append((c["name"], f"{c['pinstage_us']:.1f}", f"{c['pinstage_spread_us']:.1f}",
                     f"{c['baseline_us']:.1f}", f"{c['baseline_spread_us']:.1f}",
                     f"{c['speedup']:.2f}x"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for k, r in enumerate(rows):
        lines.append("  ".join(v.ljust(widths[i]) if i == 0 else v.rjust(widths[i])
                               for i, v in enumerate(r)))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = report["cases"]
    names = [c["name"] for c in cases]
    ours = [c["pinstage_us"] for c in cases]
    base = [c["baseline_us"] for c in cases]
    speed = [c["speedup"] for c in cases]
    y = list(range(len(cases)))[::-1]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 0.55 * len(cases) + 2.2),
                                   gridspec_kw={"width_ratios": [3, 2]}, sharey=True)
    h = 0.38
    ax1.barh([v + h / 2 for v in y], base, h, label="straightforward PyTorch", color="#9aa5b1")
    ax1.barh([v - h / 2 for v in y], ours, h, label="pinstage", color="#1f77b4")
    ax1.set_xscale("log")
    ax1.set_yticks(y, names)
    ax1.set_xlabel("time per call, microseconds (log scale, lower is better)")
    ax1.legend(loc="lower right", fontsize=8)
    colors = ["#2ca02c" if s >= 1 else "#d62728" for s in speed]
    ax2.barh(y, speed, 0.6, color=colors)
    ax2.axvline(1.0, color="black", linewidth=0.8)
    for yy, s in zip(y, speed):
        ax2.text(s, yy, f" {s:.1f}x", va="center", fontsize=8)
    ax2.set_xlabel("speedup = baseline / pinstage (higher is better)")
    ax2.set_xlim(0, max(speed) * 1.25 + 0.1)
    target = report["target"]
    fig.suptitle(f"pinstage bench on {target} ({report.get('device_name', '')}), median of "
                 f"{cases[0]['rounds'] if cases else 0} interleaved rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.plot and not _have("matplotlib"):
        print(f"pinstage bench --plot needs matplotlib: {BENCH_EXTRA_HINT}", file=sys.stderr)
        return 2
    from .bench import run_suite

    cb, close = _progress_printer()
    try:
        report = run_suite(quick=args.quick, device=args.device, progress=cb,
                           only=args.case or None)
    finally:
        close()
    print(f"pinstage bench: target {report['target']} ({report['device_name']}), "
          f"{'quick' if args.quick else 'full'} run")
    print(format_table(report))
    sim = report["simulator"]
    print(f"simulator: h2d_many of 8 arrays = {sim['h2d_many_8_transfers']} transfer(s) "
          f"(8 separate calls: {sim['separate_8_transfers']}); host stalls in 50 steady-state "
          f"engine steps: {sim['steady_state_host_stalls_50_steps']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        write_plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


# -- audit ------------------------------------------------------------------------------------


def cmd_audit(args: argparse.Namespace) -> int:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if cmd and os.path.basename(cmd[0]).startswith("python"):
        cmd = cmd[1:]
    if not cmd:
        print("usage: pinstage audit [--strict] -- python script.py [args]", file=sys.stderr)
        return 2
    import pinstage

    old_argv = sys.argv
    code = 0
    with pinstage.audit() as report:
        try:
            if cmd[0] == "-m" and len(cmd) > 1:
                sys.argv = cmd[1:]
                runpy.run_module(cmd[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = cmd
                sys.path.insert(0, os.path.dirname(os.path.abspath(cmd[0])))
                runpy.run_path(cmd[0], run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            sys.argv = old_argv
    print(report.summary(), file=sys.stderr)
    if args.strict and report.findings:
        return 1
    return code


# -- entry ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pinstage", description="Host-to-device staging for "
                                "PyTorch without hidden host stalls.")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("doctor", help="what this machine can do, why, and advice")
    d.add_argument("--json", action="store_true", help="print one JSON object")
    d.add_argument("--device", default=None, help="target device (default: the best one)")
    d.add_argument("--no-probe", action="store_true", help="skip the GPU bandwidth probe")
    d.set_defaults(func=cmd_doctor)
    b = sub.add_parser("bench", help="pinstage vs the straightforward PyTorch way")
    b.add_argument("--quick", action="store_true", help="fewer rounds (under a minute)")
    b.add_argument("--json", metavar="PATH", help="write the results as JSON")
    b.add_argument("--plot", metavar="PATH", help="write a PNG chart (needs pinstage[bench])")
    b.add_argument("--device", default=None, help="target device (default: the best one)")
    b.add_argument("--case", action="append", help="run only this case (repeatable)")
    b.set_defaults(func=cmd_bench)
    a = sub.add_parser("audit", help="run a script under the hidden-sync audit")
    a.add_argument("--strict", action="store_true", help="exit 1 if anything was found")
    a.add_argument("command", nargs=argparse.REMAINDER, help="-- python script.py [args]")
    a.set_defaults(func=cmd_audit)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
