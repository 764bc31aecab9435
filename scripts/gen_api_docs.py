"""Write docs/api.md, the API reference, from the code: every name in ``pinstage.__all__`` and
``pinstage.testing.__all__`` with its signature and docstring (classes with their public
methods and properties).

    python scripts/gen_api_docs.py          # rewrite docs/api.md
    python scripts/gen_api_docs.py --check  # exit 1 if docs/api.md is not what this writes

tests/test_packaging.py fails when a public name is missing from the file or the file is stale.
"""

from __future__ import annotations

import argparse
import enum
import inspect
import pathlib
import re
import sys
from types import ModuleType
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "api.md"

HEADER = """\
# API reference

Every public name of `pinstage` and `pinstage.testing`, with its signature and docstring, as
the code has them (written by `scripts/gen_api_docs.py`; a test fails when this file is out of
date). The behaviour they promise is explained in the README; the command line in
`command-line.md`.
"""


def _clean(sig: str) -> str:
    """A signature as written in the code: annotations unquoted (the modules use postponed
    annotations, so they are strings), no run-specific detail (object addresses)."""
    sig = re.sub(r"(: |-> )'([^']*)'", r"\1\2", sig)
    sig = re.sub(r'(: |-> )"([^"]*)"', r"\1\2", sig)
    return re.sub(r" at 0x[0-9a-f]+", "", sig)


def _signature(obj: Any, name: str) -> str:
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        init = next((k.__dict__["__init__"] for k in obj.__mro__
                     if "__init__" in k.__dict__ and not k.__module__ == "builtins"), None)
        if init is None:
            return f"{name}(message)"
        sig = inspect.signature(init)
        params = list(sig.parameters.values())[1:]  # without self
        return _clean(f"{name}{sig.replace(parameters=params, return_annotation=sig.empty)}")
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    return _clean(f"{name}{sig}")


def _doc(obj: Any) -> str:
    doc = inspect.getdoc(obj)
    return doc.strip() if doc else "(no docstring)"


def _kind(obj: Any) -> str:
    if inspect.isclass(obj):
        if issubclass(obj, BaseException):
            return "exception"
        return "class"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "function"
    if callable(obj):
        return "callable"
    return "constant"


def _bases(cls: type) -> str:
    names = [b.__name__ for b in cls.__bases__ if b is not object and b.__name__ != "Generic"]
    return f" (a subclass of {', '.join(f'`{n}`' for n in names)})" if names else ""


def _members(cls: type) -> list[str]:
    """The public methods and properties ``cls`` defines itself (not those it inherits)."""
    out: list[str] = []
    if issubclass(cls, BaseException):
        return out
    for attr, raw in sorted(vars(cls).items()):
        if attr.startswith("_"):
            continue
        if isinstance(raw, property):
            out.append(f"- **`{attr}`** (property): {_first_para(_doc(raw))}")
        elif isinstance(raw, (staticmethod, classmethod)) or inspect.isfunction(raw):
            fn = getattr(cls, attr)
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                sig_text = "(...)"
            else:
                sig_text = _clean(str(sig))
            out.append(f"- **`{attr}{sig_text}`**: {_first_para(_doc(raw))}")
    return out


def _first_para(doc: str) -> str:
    return " ".join(doc.split("\n\n", 1)[0].split())


def _section(module: ModuleType, name: str) -> str:
    obj = getattr(module, name)
    qual = f"{module.__name__}.{name}"
    kind = _kind(obj)
    lines = [f"### `{qual}`", ""]
    if kind == "constant":
        if isinstance(obj, bool) or name == "PIN_MEMORY":
            lines += ["```python", f"{name}: bool", "```", "",
                      "Whether pinned memory is in use for the current device "
                      "(`is_pin_memory_available()`), evaluated each time it is read, never at "
                      "import (vLLM's module-level `PIN_MEMORY`)."]
        else:
            value = obj.value if isinstance(obj, enum.Enum) else obj
            lines += ["```python", f"{name} = {value!r}", "```"]
        return "\n".join(lines) + "\n"
    lines += ["```python", _signature(obj, name), "```", ""]
    header = f"*{kind}*" + (_bases(obj) if inspect.isclass(obj) else "")
    lines += [header, "", _doc(obj)]
    members = _members(obj) if inspect.isclass(obj) else []
    if members:
        lines += ["", *members]
    return "\n".join(lines) + "\n"


def render() -> str:
    """The text of docs/api.md for the code as it is now."""
    sys.path.insert(0, str(ROOT))
    try:
        import pinstage
        import pinstage.testing
    finally:
        sys.path.pop(0)
    parts = [HEADER]
    for module in (pinstage, pinstage.testing):
        names = sorted(module.__all__, key=lambda n: (n.lower(), n))
        parts.append(f"## `{module.__name__}`\n")
        first = _first_para(inspect.getdoc(module) or "")
        if first:
            parts.append(first + "\n")
        parts.append("Names: " + ", ".join(f"`{n}`" for n in names) + ".\n")
        parts += [_section(module, n) for n in names]
    return "\n".join(parts).rstrip() + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true",
                   help="exit 1 if docs/api.md differs from what would be written")
    args = p.parse_args()
    text = render()
    if args.check:
        current = OUT.read_text(encoding="utf-8") if OUT.exists() else ""
        if current != text:
            print(f"{OUT.relative_to(ROOT)} is out of date: run python scripts/gen_api_docs.py",
                  file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
