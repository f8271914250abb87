"""torch_odc/_C.pyi against the built extension (CPU only).

Every name the binding puts on the module and on its classes (public and private) is in the
stub, and the stub declares nothing else; each is a property in both or a method / function in
both, with the argument names pybind11 bound (read from its signature line) in order, the same
ones defaulted, and ``argN`` (bound without a name) positional only; classes have the same bases.
And the package data ships the stub and py.typed.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import torch_odc
from torch_odc import _C

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "torch_odc" / "_C.pyi"
# What every extension module and pybind11 class has, that the binding does not define.
MODULE_BOILERPLATE = {"__doc__", "__file__", "__loader__", "__name__", "__package__", "__spec__"}
CLASS_BOILERPLATE = {"__doc__", "__module__", "__dict__", "__weakref__", "_pybind11_conduit_v1_"}


def _stub() -> ast.Module:
    return ast.parse(STUB.read_text(), str(STUB))


def _stub_members(body) -> dict[str, ast.AST]:
    """The names a stub body defines (imports left out: they are the stub's own)."""
    out = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            assert node.name not in out, f"_C.pyi defines {node.name} twice"
            out[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    out[target.id] = node
    return out


def _binding_members(obj, boilerplate) -> dict[str, object]:
    names = dir(obj) if isinstance(obj, type(sys)) else list(vars(obj))
    return {
        n: getattr(obj, n) if isinstance(obj, type(sys)) else vars(obj)[n]
        for n in names
        if n not in boilerplate
    }


def _is_property(node: ast.AST) -> bool:
    return isinstance(node, ast.FunctionDef) and any(
        isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list
    )


def _split_top(text: str) -> list[str]:
    """`text` split at the commas outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _bound_args(name: str, fn) -> list[tuple[str, bool]]:
    """(argument, has a default) per argument pybind11 bound, `self` left out, from the
    signature line it writes first in the docstring: ``name(a: T, b: T = x) -> R``."""
    doc = fn.__doc__ or ""
    assert doc.startswith(name + "("), f"{name}: no pybind11 signature line in {doc[:80]!r}"
    assert "Overloaded function" not in doc.split("\n", 1)[0], f"{name}: overloads"
    depth, end = 0, None
    for i, ch in enumerate(doc[len(name) :], start=len(name)):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if depth == 0:
            end = i
            break
    inner = doc[len(name) + 1 : end]
    out = []
    for part in _split_top(inner):
        arg = part.split(":", 1)[0].strip()
        out.append((arg, "=" in part.split(":", 1)[-1]))
    if out and out[0][0] == "self":
        out = out[1:]
    return out


def _stub_args(node: ast.FunctionDef, method: bool) -> tuple[list[tuple[str, bool]], set[str]]:
    """(argument, has a default) per argument of a stub function, `self` left out, and the
    positional-only ones."""
    a = node.args
    positional = a.posonlyargs + a.args
    defaults = [False] * (len(positional) - len(a.defaults)) + [True] * len(a.defaults)
    out = [(p.arg, d) for p, d in zip(positional, defaults, strict=True)]
    out += [(p.arg, d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults, strict=True)]
    assert a.vararg is None and a.kwarg is None, f"{node.name}: *args/**kwargs in the stub"
    posonly = {p.arg for p in a.posonlyargs}
    if method:
        assert out and out[0][0] == "self", f"{node.name}: no self"
        out = out[1:]
    return out, posonly


def _check_callable(where: str, name: str, bound, node: ast.AST, method: bool):
    assert isinstance(node, ast.FunctionDef) and not _is_property(node), (
        f"{where}{name} is a function in the binding, not in _C.pyi"
    )
    want = _bound_args(name, bound)
    got, posonly = _stub_args(node, method)
    assert got == want, f"{where}{name}: bound as {want}, the stub says {got}"
    for arg, _ in want:
        if arg.startswith("arg") and arg[3:].isdigit():
            assert arg in posonly, f"{where}{name}: {arg} is bound without a name: add `, /`"


def test_stub_module_names_match_the_binding():
    stub, bound = _stub_members(_stub().body), _binding_members(_C, MODULE_BOILERPLATE)
    assert {"OdcBackend", "KeyCalls", "_plan_balance"} <= set(bound)
    missing = sorted(set(bound) - set(stub))
    assert not missing, f"the binding defines {missing}, torch_odc/_C.pyi does not"
    extra = sorted(set(stub) - set(bound))
    assert not extra, f"torch_odc/_C.pyi declares {extra}, which the binding does not define"
    for name, obj in bound.items():
        node = stub[name]
        if isinstance(obj, type):
            assert isinstance(node, ast.ClassDef), f"{name}: a class in the binding"
        else:
            _check_callable("", name, obj, node, method=False)


CLASSES = sorted(n for n in dir(_C) if isinstance(getattr(_C, n), type))


@pytest.mark.parametrize("cls_name", CLASSES)
def test_stub_class_members_match_the_binding(cls_name):
    cls = getattr(_C, cls_name)
    (node,) = [n for n in _stub().body if isinstance(n, ast.ClassDef) and n.name == cls_name]
    bases = [b.__name__ for b in cls.__bases__ if b.__name__ != "pybind11_object"]
    stub_bases = [ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases]
    assert stub_bases == bases, f"{cls_name}: bases {bases} in the binding, {stub_bases} in _C.pyi"
    stub, bound = _stub_members(node.body), _binding_members(cls, CLASS_BOILERPLATE)
    missing = sorted(set(bound) - set(stub))
    assert not missing, f"the binding's {cls_name} defines {missing}, torch_odc/_C.pyi does not"
    extra = sorted(set(stub) - set(bound))
    assert not extra, f"torch_odc/_C.pyi's {cls_name} declares {extra}, which the binding does not"
    for name, obj in bound.items():
        if isinstance(obj, property):
            assert _is_property(stub[name]), f"{cls_name}.{name} is a property in the binding"
        else:
            _check_callable(f"{cls_name}.", name, obj, stub[name], method=True)


def test_stub_sits_beside_the_extension_with_the_typed_marker():
    package = Path(torch_odc.__file__).parent
    assert Path(_C.__file__).parent == package
    assert (package / "_C.pyi").is_file() and (package / "py.typed").is_file()


def test_package_data_ships_the_stub_and_the_marker(tmp_path):
    """setup.py's build_py (what a wheel and an editable install copy or map) copies both; it
    compiles nothing."""
    out = subprocess.run(
        [sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(tmp_path)],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    for name in ("_C.pyi", "py.typed", "__init__.py"):
        assert (tmp_path / "torch_odc" / name).is_file(), sorted(
            p.name for p in (tmp_path / "torch_odc").iterdir()
        )
