"""Generate ``docs/api.md``, the API reference, from aruntime's docstrings with pdoc.

pdoc imports each module and builds its documentation model (members, signatures,
docstrings converted to Markdown); this script writes that model out as one
Markdown page, without source code, so the page changes only when a public
signature or docstring does::

    python docs/build_api.py                # rewrite docs/api.md
    python docs/build_api.py --check        # exit 1 when docs/api.md is out of date
    python docs/build_api.py -o OUT.md      # write somewhere else
    python docs/build_api.py --html DIR     # also render pdoc's HTML site into DIR

``tests/test_docs.py`` regenerates the page and compares it with the committed one.
"""

from __future__ import annotations

import argparse
import inspect
import os
import pkgutil
import re
import sys
from pathlib import Path
from typing import TypeVar

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
DEFAULT_OUT = DOCS / "api.md"
PACKAGE = "aruntime"

HEADER = """\
# API reference

Generated from the docstrings by `python docs/build_api.py` (with pdoc); do not
edit by hand. `tests/test_docs.py` fails when this page is out of date. For a
browsable HTML version run `python docs/build_api.py --html site/`.

The names most programs need are importable from `aruntime` itself
(`Device`, `Scheduler`, `Graph`, `Param`, `Batcher`, `transfer`,
`from_dlpack`, the errors...); they are documented below in the modules that
define them (`aruntime.scheduler.Scheduler`, `aruntime.graph.Graph`...).
`aruntime.__version__` is the installed version.
"""

_QUALIFIED = re.compile(r"\b(?:" + PACKAGE + r"(?:\.\w+)*|collections\.abc|typing)\.(?=\w)")
_DOUBLE_TICKS = re.compile(r"``([^`]+)``")
_ROLE_TILDE = re.compile(r"`~([\w.]+)\.(\w+)(\(\))?`")


def module_names() -> list[str]:
    """Every public module of the package (no ``_private`` ones, no ``__main__``), in name order."""
    import importlib

    pkg = importlib.import_module(PACKAGE)
    names = [PACKAGE]
    for info in pkgutil.walk_packages(pkg.__path__, PACKAGE + "."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        names.append(info.name)
    return sorted(names)


def short(text: str) -> str:
    """Drop the package's module paths from type names: ``aruntime.engine.Op`` -> ``Op``."""
    return _QUALIFIED.sub("", text)


def markdown(docstring: str) -> str:
    """A docstring (reST flavoured) as Markdown."""
    import pdoc.docstrings

    text = pdoc.docstrings.convert(docstring, "restructuredtext", None)
    text = _ROLE_TILDE.sub(lambda m: f"`{m.group(2)}{m.group(3) or ''}`", text)
    text = _DOUBLE_TICKS.sub(r"`\1`", text)
    text = text.replace("::\n\n", ":\n\n")
    return text.strip()


def signature(fn: object, method: bool) -> str:
    """One-line signature of a pdoc Function (without ``self`` or ``cls`` for a method)."""
    import pdoc.doc

    assert isinstance(fn, pdoc.doc.Function)
    sig = fn.signature_without_self if method and not fn.is_staticmethod else fn.signature
    return short(inspect.Signature.__str__(sig))


def _anchor(name: str) -> str:
    return f'<a id="{name}"></a>'


def _is_public(name: str) -> bool:
    return not name.startswith("_")


def _own_doc(member: object) -> str | None:
    """The member's own docstring for a dunder method (inherited ones like ``object.__repr__``'s are not)."""
    obj = getattr(member, "obj", None)
    doc = getattr(obj, "__doc__", None)
    return doc if isinstance(doc, str) and doc.strip() else None


def render_function(fn: object, prefix: str, level: str, method: bool) -> list[str]:
    import pdoc.doc

    assert isinstance(fn, pdoc.doc.Function)
    kind = "async " if "async" in fn.funcdef else ""
    if fn.is_classmethod:
        kind += "classmethod "
    elif fn.is_staticmethod:
        kind += "staticmethod "
    out = [f"{level} {kind}`{prefix}{fn.name}{signature(fn, method)}`", ""]
    if fn.docstring:
        out += [markdown(fn.docstring), ""]
    return out


def render_variable(var: object, prefix: str, level: str) -> list[str]:
    import pdoc.doc

    assert isinstance(var, pdoc.doc.Variable)
    head = f"{prefix}{var.name}"
    if var.annotation_str:
        head += short(var.annotation_str)
    value = var.default_value_str
    if value and len(value) <= 80 and "\n" not in value and not value.startswith("<"):
        head += f" = {short(value)}"
    out = [f"{level} `{head}`", ""]
    if var.docstring:
        out += [markdown(var.docstring), ""]
    return out


def render_members(cls: object, prefix: str, level: str) -> list[str]:
    """The public methods, properties and attributes a pdoc Class defines itself (inherited ones are not repeated).

    Members without a docstring of their own (plain attributes, overrides that keep
    the base class's contract) are only named.
    """
    import pdoc.doc

    assert isinstance(cls, pdoc.doc.Class)
    out: list[str] = []
    bare: list[str] = []
    for member in cls.own_members:
        name = member.name
        if name == "__init__":
            continue
        dunder = name.startswith("__") and name.endswith("__")
        if isinstance(member, pdoc.doc.Function):
            if _own_doc(member) is None:
                if not dunder and _is_public(name):
                    bare.append(f"`{name}`")
                continue
            if dunder or _is_public(name):
                out += render_function(member, prefix, level, True)
        elif isinstance(member, pdoc.doc.Variable) and _is_public(name):
            if member.docstring:
                out += render_variable(member, prefix, level)
            else:
                bare.append(f"`{name}`")
    if bare:
        out = [f"Also defines: {', '.join(bare)}.", "", *out]
    return out


def render_class(cls: object) -> list[str]:
    import pdoc.doc

    assert isinstance(cls, pdoc.doc.Class)
    init = cls.members.get("__init__")
    sig = signature(init, True) if isinstance(init, pdoc.doc.Function) and not init.is_inherited else ""
    bases = [short(f"{mod}.{qual}") for mod, qual, _ in cls.bases if (mod, qual) != ("builtins", "object")]
    out = [_anchor(cls.fullname), f"### class `{cls.name}{sig}`", ""]
    if bases:
        out += [f"Bases: {', '.join(f'`{b}`' for b in bases)}", ""]
    if cls.docstring:
        out += [markdown(cls.docstring), ""]
    if isinstance(init, pdoc.doc.Function) and not init.is_inherited and _own_doc(init):
        out += [markdown(_own_doc(init) or ""), ""]
    out += render_members(cls, f"{cls.name}.", "####")
    return out


def render_module(name: str) -> list[str]:
    import pdoc.doc

    mod = pdoc.doc.Module.from_name(name)
    out = [_anchor(name), f"## `{name}`", ""]
    if mod.docstring:
        out += [markdown(mod.docstring), ""]
    reexports: list[str] = []
    for member in mod.members.values():
        if not _is_public(member.name):
            continue
        origin = member.taken_from[0]
        if origin != name:
            reexports.append(
                f"[`{member.name}`](#{origin}.{member.name})" if origin.startswith(PACKAGE) else member.name
            )
            continue
        if isinstance(member, pdoc.doc.Class):
            out += render_class(member)
        elif isinstance(member, pdoc.doc.Function):
            out += [_anchor(member.fullname), *render_function(member, "", "###", False)]
        elif isinstance(member, pdoc.doc.Variable) and not isinstance(getattr(mod.obj, member.name, None), TypeVar):
            out += [_anchor(member.fullname), *render_variable(member, "", "###")]
            out += _instance_members(mod, member)
    if reexports:
        out += [f"Re-exported here: {', '.join(reexports)}.", ""]
    return out


def _instance_members(mod: object, var: object) -> list[str]:
    """For a public object whose class is private (e.g. the ``Device`` registry): that class's members."""
    import pdoc.doc

    assert isinstance(mod, pdoc.doc.Module) and isinstance(var, pdoc.doc.Variable)
    value = getattr(mod.obj, var.name, None)
    cls_name = type(value).__name__
    cls = mod.members.get(cls_name)
    if not cls_name.startswith("_") or not isinstance(cls, pdoc.doc.Class):
        return []
    return render_members(cls, f"{var.name}.", "####")


def stamp() -> str:
    """The versions the page depends on besides the docstrings: Python's signature rendering and pdoc's."""
    import pdoc

    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    return f"<!-- generated by docs/build_api.py with Python {python}, pdoc {pdoc.__version__} -->"


def build() -> str:
    """The whole page."""
    names = module_names()
    lines = [stamp(), "", HEADER, "## Modules", ""]
    lines += [f"- [`{n}`](#{n})" for n in names]
    lines.append("")
    for name in names:
        lines += render_module(name)
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.rstrip() + "\n"


def render_html(out_dir: Path) -> None:
    """pdoc's own HTML site for the package."""
    import pdoc
    import pdoc.render

    pdoc.render.configure(docformat="restructuredtext", show_source=False, search=True)
    pdoc.pdoc(*module_names(), output_directory=out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-o", "--output", type=Path, default=DEFAULT_OUT, help="where to write (default docs/api.md)")
    parser.add_argument("--check", action="store_true", help="exit 1 when the output file is out of date")
    parser.add_argument("--html", type=Path, help="also write pdoc's HTML site into this directory")
    args = parser.parse_args(argv)
    os.environ.pop("ARUNTIME_DEFAULT_FLOAT", None)  # module-level defaults must not depend on the caller's environment
    text = build()
    if args.check:
        current = args.output.read_text() if args.output.exists() else ""
        if current != text:
            print(f"{args.output} is out of date: run python docs/build_api.py", file=sys.stderr)
            return 1
        return 0
    args.output.write_text(text)
    if args.html is not None:
        render_html(args.html)
    return 0


if __name__ == "__main__":
    sys.exit(main())
