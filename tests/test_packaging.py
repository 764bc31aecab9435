"""What a user installs, as far as it can be checked without building (scripts/
check_installed.py, run by .ci/run, builds and installs it): one version, every subpackage
found by discovery, the sdist's contents, the license, the metadata a package index shows, and
the types a user's ``mypy --strict`` sees."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

import pinstage

ROOT = pathlib.Path(__file__).resolve().parent.parent

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = None  # type: ignore[assignment]


@pytest.fixture(scope="module")
def pyproject() -> dict:
    if tomllib is None:
        pytest.skip("needs tomllib (Python >= 3.11)")
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_one_version_literal(pyproject):
    """The version is written once, in pinstage/_version.py; the build reads it from there."""
    project = pyproject["project"]
    assert "version" not in project and "version" in project["dynamic"]
    attr = pyproject["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    assert attr == "pinstage._version.__version__"
    from pinstage import _version

    assert pinstage.__version__ == _version.__version__
    literals = []
    for path in [*(ROOT / "pinstage").rglob("*.py"), ROOT / "pyproject.toml"]:
        text = path.read_text(encoding="utf-8")
        literals += [(path.name, m) for m in re.findall(
            r"""(?:__version__|^version)\s*=\s*["'](\d+\.\d+[^"']*)["']""", text, flags=re.M)]
    assert literals == [("_version.py", _version.__version__)], literals


def test_version_equals_the_installed_metadata():
    assert pinstage.__version__ == importlib.metadata.version("pinstage")


def test_cli_version_is_the_package_version(capsys):
    from pinstage import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"pinstage {pinstage.__version__}"


def test_discovery_finds_every_subpackage(pyproject):
    """Every directory of pinstage/ holding modules is a package the discovery includes (a
    hand list once left pinstage._sim out of the wheel)."""
    tool = pyproject["tool"]["setuptools"]
    assert "packages" not in tool or isinstance(tool["packages"], dict)
    find = tool["packages"]["find"]
    assert find["include"] == ["pinstage*"]
    find_packages = pytest.importorskip("setuptools").find_packages

    found = set(find_packages(where=str(ROOT), include=find["include"]))
    dirs = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "pinstage").rglob("*.py")
            if "__pycache__" not in p.parts}
    assert dirs <= found, dirs - found
    assert {"pinstage", "pinstage._sim"} <= found
    assert all((ROOT / d.replace(".", "/") / "__init__.py").is_file() for d in dirs)
    assert "py.typed" in pyproject["tool"]["setuptools"]["package-data"]["pinstage"]
    assert (ROOT / "pinstage" / "py.typed").is_file()


def test_manifest_ships_docs_and_license_and_no_tests():
    lines = [ln.split("#")[0].split() for ln in
             (ROOT / "MANIFEST.in").read_text(encoding="utf-8").splitlines()]
    lines = [ln for ln in lines if ln]
    assert ["prune", "tests"] in lines
    included = {w for ln in lines if ln[0] in ("include", "graft") for w in ln[1:]}
    assert {"LICENSE", "README.md", "CHANGELOG.md", "docs", "examples"} <= included
    for name in ("LICENSE", "README.md", "CHANGELOG.md"):
        assert (ROOT / name).is_file(), name


def test_license_is_apache_2(pyproject):
    project = pyproject["project"]
    assert project["license"] == "Apache-2.0"  # SPDX (the table form is deprecated)
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert "END OF TERMS AND CONDITIONS" in text and len(text) > 10000
    requires = pyproject["build-system"]["requires"]
    assert any(re.fullmatch(r"setuptools>=(\d+)", r) and int(r.split(">=")[1]) >= 77
               for r in requires), requires  # SPDX license expressions need setuptools 77


def test_index_metadata(pyproject):
    project = pyproject["project"]
    classifiers = project["classifiers"]
    assert "Typing :: Typed" in classifiers
    assert any(c.startswith("Operating System ::") for c in classifiers)
    assert any(c.startswith("Topic ::") for c in classifiers)
    versions = [c for c in classifiers if re.fullmatch(r"Programming Language :: Python :: 3\.\d+",
                                                       c)]
    assert "Programming Language :: Python :: 3.10" in versions  # requires-python's floor
    assert project["requires-python"] == ">=3.10"
    assert len(project["keywords"]) >= 5
    assert set(project["dependencies"]) == {"torch>=2.4", "numpy>=1.24"}


def test_readme_renders_on_a_package_index():
    """A package index shows the README without the repository: no relative link or image."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    readme = re.sub(r"```.*?```", "", readme, flags=re.S)  # code is not a link
    readme = re.sub(r"`[^`\n]*`", "", readme)
    targets = re.findall(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)", readme)
    targets += re.findall(r"""<img[^>]+src=["']([^"']+)""", readme)
    relative = [t for t in targets if not re.match(r"(https?:|mailto:|#)", t)]
    assert relative == [], relative


def test_changelog_is_keep_a_changelog():
    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert text.startswith("# Changelog") and "Keep a Changelog" in text
    assert "## [Unreleased]" in text
    assert f"## [{pinstage.__version__}]" in text


def test_ci_checks_the_installed_package():
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert "scripts/check_installed.py" in ci
    script = (ROOT / "scripts" / "check_installed.py").read_text(encoding="utf-8")
    assert "torch==2.13.0" in script and "--pinstage-simulate" in script


REVEALED = ('Revealed type is "numpy.ndarray', 'Revealed type is "None"',
            'Revealed type is "bool"', 'Revealed type is "pinstage._sim.Simulator"',
            'Revealed type is "pinstage._sim._sched.SimStats"')


@pytest.mark.timeout(300)
def test_typed_user_script_passes_mypy_strict():
    """tests/typed/user_script.py (a user's script: ``buf.np[:] = 1``, ``PIN_MEMORY``, the
    simulator and its stats) passes ``mypy --strict`` with the types it expects, not ``Any``.
    (scripts/check_installed.py runs it against the installed package too.)"""
    if shutil.which("mypy") is None and importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed")
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                           "tests/typed/user_script.py"], capture_output=True, text=True,
                          timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for revealed in REVEALED:
        assert revealed in proc.stdout, (revealed, proc.stdout)
    spec = importlib.util.spec_from_file_location("check_installed",
                                                  ROOT / "scripts" / "check_installed.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert tuple(module.REVEALED) == REVEALED  # the install check expects the same


def test_host_memory_stats_says_it_is_not_torchs():
    """Same name as torch.cuda.host_memory_stats(), other keys: its docstring and the README
    say so."""
    doc = " ".join((pinstage.host_memory_stats.__doc__ or "").split())
    assert "torch.cuda.host_memory_stats()" in doc
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert "not the same keys as `torch.cuda.host_memory_stats()`" in readme


def test_readme_compares_the_audit_with_sync_debug_mode():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "torch.cuda.set_sync_debug_mode" in readme
    section = readme[readme.index("torch.cuda.set_sync_debug_mode"):]
    assert "pageable" in section[:3000] and "real CUDA device" in section[:3000]


def _gen_api_docs():
    spec = importlib.util.spec_from_file_location("gen_api_docs",
                                                  ROOT / "scripts" / "gen_api_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_lists_every_public_name():
    import pinstage.testing

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    for module in (pinstage, pinstage.testing):
        for name in module.__all__:
            heading = f"### `{module.__name__}.{name}`"
            assert heading in text, f"{heading} is missing from docs/api.md"
            section = text.split(heading, 1)[1].split("\n### ", 1)[0]
            assert f"{name}(" in section or f"{name}:" in section or f"{name} =" in section, name
            obj = getattr(module, name)
            doc = inspect.getdoc(obj) if not isinstance(obj, (bool, tuple)) else None
            if doc and callable(obj):
                assert doc.splitlines()[0].strip() in section, name


def test_api_reference_is_up_to_date():
    """docs/api.md is what scripts/gen_api_docs.py writes for the code as it is (after a change
    to a public signature or docstring: python scripts/gen_api_docs.py)."""
    expected = _gen_api_docs().render()
    current = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert current == expected, "docs/api.md is stale: run python scripts/gen_api_docs.py"


def test_importing_every_module_runs_nothing():
    """A user's (or a checker's) walk over the package imports ``pinstage.__main__`` too: it
    must not run the command."""
    proc = subprocess.run([sys.executable, "-c", "import pkgutil, importlib, pinstage\n"
                           "for m in pkgutil.walk_packages(pinstage.__path__, 'pinstage.'):\n"
                           "    importlib.import_module(m.name)\n"
                           "print('all imported')"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0 and proc.stdout.strip() == "all imported", proc.stderr
