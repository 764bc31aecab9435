"""Check pinstage as users get it: built, installed (not editable) into a fresh venv, used from
outside the source tree.

    python scripts/check_installed.py [--keep DIR]

builds the sdist and the wheel (``python -m build``: the wheel is built from the sdist, so a
file missing from the sdist fails here too), makes a fresh venv with the CPU torch
(``torch==2.13.0``), installs the wheel and pytest into it, and runs this script again with
that venv's Python (``--inside``) from a temporary directory. Inside, it checks that

* every module of the source tree is installed and imports (``pkgutil`` over the installed
  package, compared with ``pinstage/**/*.py`` of the tree and the wheel's RECORD);
* ``pinstage.__version__`` equals the installed distribution's version;
* ``py.typed`` is installed, and the sdist holds ``LICENSE`` and ``py.typed`` and no tests;
* a user's test file that only says ``device="cuda"`` passes under ``pytest
  --pinstage-simulate`` (the plugin found through its entry point);
* ``pinstage doctor`` (text and ``--json``), ``pinstage --version`` and
  ``examples/engine_step.py --simulate`` run;
* ``tests/typed/user_script.py`` passes ``mypy --strict`` against the installed package
  (where the outer Python has mypy).

Exit status 0 when everything holds; each failure is one ``FAIL`` line.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH = "torch==2.13.0"  # the CPU build on this project's machines (never a bare torch)

# what mypy must reveal in tests/typed/user_script.py (``Any`` would pass --strict silently)
REVEALED = ('Revealed type is "numpy.ndarray', 'Revealed type is "None"',
            'Revealed type is "bool"', 'Revealed type is "pinstage._sim.Simulator"',
            'Revealed type is "pinstage._sim._sched.SimStats"')

USER_TEST = '''\
import pytest
import torch

import pinstage

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@requires_cuda
def test_user_kernel():
    x = torch.arange(4, device="cuda")
    assert (x * 2).tolist() == [0, 2, 4, 6]


@requires_cuda
def test_user_pinned_upload():
    src = torch.arange(8).pin_memory()
    dst = torch.empty(8, dtype=torch.int64, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert dst.cpu().tolist() == list(range(8))


@requires_cuda
def test_user_staging():
    t = pinstage.async_tensor_h2d([1, 2, 3], device="cuda", dtype=torch.int32)
    assert t.device.type == "cuda" and t.tolist() == [1, 2, 3]


def test_fixture(simulated_cuda):
    assert simulated_cuda.device.type == "cuda"
'''


def _run(cmd: list[str], cwd: pathlib.Path | str | None = None, timeout: float = 600,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                          env=env)


def _step(name: str, t0: float) -> None:
    print(f"check_installed: {name} ({time.monotonic() - t0:.1f} s)", flush=True)


# -- outside: build, make the venv, run the checks in it ------------------------------------


def outside(keep: str | None) -> int:
    t0 = time.monotonic()
    work = pathlib.Path(keep) if keep else pathlib.Path(tempfile.mkdtemp(prefix="pinstage-ci-"))
    work.mkdir(parents=True, exist_ok=True)
    dist = work / "dist"
    shutil.rmtree(dist, ignore_errors=True)
    try:
        # build from a clean copy: a stale *.egg-info (an editable install leaves one) feeds
        # its file list into the sdist and can hide a module the package config leaves out
        src = work / "src"
        shutil.rmtree(src, ignore_errors=True)
        shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
            ".git", ".venv", "*.egg-info", "build", "dist", "__pycache__", ".mypy_cache",
            ".pytest_cache", ".hypothesis", ".ruff_cache", "bench-out"))
        proc = _run([sys.executable, "-m", "build", "--outdir", str(dist), str(src)])
        if proc.returncode != 0:
            print(proc.stdout[-3000:] + proc.stderr[-3000:])
            print("FAIL: python -m build (is the 'build' package installed? it is in the "
                  "test extra)")
            return 1
        warnings = [ln for ln in proc.stdout.splitlines() + proc.stderr.splitlines()
                    if "Deprecat" in ln or "SetuptoolsWarning" in ln]
        if warnings:
            print("\n".join(warnings))
            print("FAIL: the build warns (deprecated packaging metadata)")
            return 1
        _step("built " + ", ".join(sorted(p.name for p in dist.iterdir())), t0)
        venv = work / "venv"
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = venv / "bin" / "python"
        wheel = next(dist.glob("*.whl"))
        for args in ([TORCH], [str(wheel), "pytest"]):  # torch first: never a CUDA build
            proc = _run([str(py), "-m", "pip", "install", "-q", *args])
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-3000:])
                print(f"FAIL: pip install {' '.join(args)} into a fresh venv")
                return 1
        _step(f"installed {wheel.name} (not editable) with {TORCH} into a fresh venv", t0)
        run_dir = work / "user"
        shutil.rmtree(run_dir, ignore_errors=True)
        run_dir.mkdir()
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("PINSTAGE_")}
        proc = subprocess.run([str(py), str(ROOT / "scripts" / "check_installed.py"),
                               "--inside", "--dist", str(dist)], cwd=run_dir, env=env,
                              timeout=600)
        status = proc.returncode
        if status == 0:
            status = _mypy_installed(py, run_dir)
        _step("done" if status == 0 else "FAILED", t0)
        return status
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _mypy_installed(py: pathlib.Path, run_dir: pathlib.Path) -> int:
    """``mypy --strict`` on the typed user script, against the package installed in ``py``'s
    venv (PEP 561: pinstage is typed through its ``py.typed``)."""
    import importlib.util

    if importlib.util.find_spec("mypy") is None:
        print("check_installed: mypy is not installed here; the typed user script is not "
              "checked against the installed package")
        return 0
    script = run_dir / "user_script.py"
    shutil.copy(ROOT / "tests" / "typed" / "user_script.py", script)
    t0 = time.monotonic()
    proc = _run([sys.executable, "-m", "mypy", "--strict", "--python-executable", str(py),
                 "--follow-imports=silent", script.name], cwd=run_dir)
    missing = [t for t in REVEALED if t not in proc.stdout]
    if proc.returncode != 0 or missing:
        print(proc.stdout + proc.stderr)
        print("FAIL: mypy --strict on tests/typed/user_script.py against the installed "
              f"package (revealed types missing: {missing})")
        return 1
    _step("mypy --strict: the typed user script passes against the installed package", t0)
    return 0


# -- inside: the checks, with the installed package --------------------------------------------


class Checks:
    def __init__(self) -> None:
        self.failed = 0

    def ok(self, cond: bool, what: str, detail: str = "") -> bool:
        if cond:
            print(f"  ok    {what}")
        else:
            self.failed += 1
            print(f"  FAIL  {what}" + (f"\n{detail}" if detail else ""))
        return cond


def _source_modules() -> set[str]:
    """Every module of the source tree's package, as dotted names."""
    names = set()
    for path in (ROOT / "pinstage").rglob("*.py"):
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        names.add(".".join(parts))
    return names


def inside(dist: pathlib.Path) -> int:
    import importlib
    import importlib.metadata as md
    import importlib.util
    import json
    import pkgutil
    import tarfile

    c = Checks()
    here = pathlib.Path.cwd()
    import pinstage

    where = pathlib.Path(pinstage.__file__).resolve()
    c.ok(ROOT not in where.parents, f"pinstage is imported from the install ({where.parent})")
    if ROOT in where.parents:
        return 1

    # every module: the installed ones import, and none of the tree's is missing
    installed = {"pinstage"} | {m.name for m in pkgutil.walk_packages(pinstage.__path__,
                                                                      "pinstage.")}
    for name in sorted(installed):
        try:
            importlib.import_module(name)  # __main__ too: importing it must run nothing
        except Exception as exc:  # noqa: BLE001 - the check reports any failure
            c.ok(False, f"import {name}", f"{type(exc).__name__}: {exc}")
    missing = _source_modules() - installed
    c.ok(not missing, f"all {len(_source_modules())} modules of the source tree are installed "
         "and import", f"missing from the install: {sorted(missing)}")
    files = md.files("pinstage") or []
    recorded = {".".join(p.with_suffix("").parts).removesuffix(".__init__")
                for p in (pathlib.PurePath(str(f)) for f in files)
                if p.suffix == ".py" and p.parts[0] == "pinstage"}
    c.ok(recorded == _source_modules(), "the wheel's RECORD lists exactly the tree's modules",
         f"RECORD - tree: {sorted(recorded - _source_modules())}; tree - RECORD: "
         f"{sorted(_source_modules() - recorded)}")

    # one version, py.typed, the license
    c.ok(pinstage.__version__ == md.version("pinstage"),
         f"pinstage.__version__ == importlib.metadata.version('pinstage') "
         f"({pinstage.__version__})", f"metadata: {md.version('pinstage')}")
    c.ok((where.parent / "py.typed").is_file(), "py.typed is installed")
    meta = md.metadata("pinstage")
    c.ok(meta.get("License-Expression") == "Apache-2.0", "License-Expression: Apache-2.0")
    c.ok(any(str(f).endswith("licenses/LICENSE") for f in files),
         "LICENSE is in the wheel's dist-info")
    sdist = next(dist.glob("*.tar.gz"))
    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    c.ok("LICENSE" in names, f"{sdist.name} holds LICENSE")
    c.ok("pinstage/py.typed" in names, f"{sdist.name} holds pinstage/py.typed")
    c.ok("pinstage/_sim/__init__.py" in names, f"{sdist.name} holds pinstage/_sim")
    c.ok(not any(n.startswith("tests/") for n in names), f"{sdist.name} ships no tests")

    # a user's CUDA-only tests under the simulator, found through the entry point
    (here / "test_user_cuda.py").write_text(USER_TEST, encoding="utf-8")
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "--pinstage-simulate", "test_user_cuda.py"], cwd=here)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    c.ok(proc.returncode == 0 and "4 passed" in last,
         f"pytest --pinstage-simulate runs a user's CUDA-only tests ({last})",
         proc.stdout[-3000:] + proc.stderr[-2000:])
    proc = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "test_user_cuda.py"], cwd=here)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    c.ok(proc.returncode == 0 and "1 passed, 3 skipped" in last,
         f"without the flag they skip ({last})", proc.stdout[-3000:] + proc.stderr[-2000:])

    # the command and an example
    exe = pathlib.Path(sys.executable).parent / "pinstage"
    proc = _run([str(exe), "--version"], cwd=here)
    c.ok(proc.returncode == 0 and proc.stdout.strip() == f"pinstage {md.version('pinstage')}",
         f"pinstage --version ({proc.stdout.strip()})", proc.stderr)
    proc = _run([str(exe), "doctor"], cwd=here)
    c.ok(proc.returncode == 0 and "advice:" in proc.stdout, "pinstage doctor",
         proc.stdout + proc.stderr)
    proc = _run([str(exe), "doctor", "--json"], cwd=here)
    try:
        data = json.loads(proc.stdout)
    except ValueError:
        data = {}
    c.ok(proc.returncode == 0 and data.get("pinstage") == md.version("pinstage"),
         "pinstage doctor --json", proc.stdout[-2000:] + proc.stderr)
    proc = _run([sys.executable, str(ROOT / "examples" / "engine_step.py"), "--simulate"],
                cwd=here)
    c.ok(proc.returncode == 0 and "simulated device work" in proc.stdout,
         "examples/engine_step.py --simulate", proc.stdout[-2000:] + proc.stderr[-3000:])
    print(f"check_installed: {'all checks passed' if not c.failed else f'{c.failed} failed'}")
    return 1 if c.failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dist", help=argparse.SUPPRESS)
    p.add_argument("--keep", metavar="DIR", help="build and install in DIR and keep it")
    args = p.parse_args()
    if args.inside:
        return inside(pathlib.Path(args.dist))
    return outside(args.keep)


if __name__ == "__main__":
    raise SystemExit(main())
