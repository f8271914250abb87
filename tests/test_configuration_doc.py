"""docs/configuration.md against the code (CPU only, no process group).

* Every ``ODC_*`` environment variable the code reads (Python under torch_odc/, benchmarks/ and
  .ci/ and setup.py, found with ast; the C++ under csrc/ through ``getenv``; the shell scripts
  of benchmarks/ and .ci/ through ``$ODC_*``) is in the page's environment tables, and every
  variable there is read somewhere.
* Every field of ``ODCConfig``, ``ODCGRPOConfig`` (imported) and ``ODCEngineConfig`` (its source
  parsed: it needs verl, which lives in its own environment) is in its table with its default,
  and the tables list no other.
* Every argument of ``attach``, ``minibatch_barrier``, the memory functions and
  ``balance.plan`` is in the API table with its default, and the table lists no other.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
ENV_NAME = re.compile(r"^ODC_[A-Z0-9_]+$")
CPP_SUFFIXES = {".c", ".cc", ".cpp", ".cxx", ".h", ".hpp", ".cu", ".cuh"}
CPP_READ = re.compile(r"getenv\s*\(\s*\"(ODC_[A-Z0-9_]+)\"")
CMAKE_READ = re.compile(r"\$ENV\{(ODC_[A-Z0-9_]+)\}")
SHELL_READ = re.compile(r"\$\{?(ODC_[A-Z0-9_]+)")
SKIP_DIRS = {"__pycache__", "results", ".venv", "build"}


# ---------------------------------------------------------------------------------------------
# What the code reads


def _files(top: Path):
    if top.is_file():
        yield top
        return
    for path in sorted(top.rglob("*")):
        if path.is_file() and not SKIP_DIRS.intersection(path.relative_to(ROOT).parts):
            yield path


def _is_shell(path: Path) -> bool:
    if path.suffix in (".sh", ".bash"):
        return True
    if path.suffix:
        return False
    try:
        first = path.read_text(errors="replace").split("\n", 1)[0]
    except OSError:
        return False
    return first.startswith("#!") and ("sh" in first.rsplit("/", 1)[-1])


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ"
    )


def _python_reads(source: str, filename: str) -> set[str]:
    """Names of the environment variables a Python file reads: ``os.environ.get(K)``,
    ``os.environ[K]``, ``os.getenv(K)``, ``K in os.environ`` (and ``setdefault`` / ``pop``),
    with K a string literal or a module-level name bound to one."""
    tree = ast.parse(source, filename)
    constants = {}
    for node in tree.body:
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            for target in node.targets:
                if isinstance(target, ast.Name):
                    constants[target.id] = node.value.value

    def key(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return node.value
        if isinstance(node, ast.Name):
            return constants.get(node.id)
        return None

    found = set()
    for node in ast.walk(tree):
        keys = []
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            from_environ = (
                isinstance(f, ast.Attribute)
                and _is_environ(f.value)
                and f.attr in ("get", "setdefault", "pop")
            )
            getenv = (isinstance(f, ast.Attribute) and f.attr == "getenv") or (
                isinstance(f, ast.Name) and f.id == "getenv"
            )
            if from_environ or getenv:
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, (ast.In, ast.NotIn)) and _is_environ(right):
                    keys.append(node.left)
        for k in keys:
            name = key(k)
            if name and ENV_NAME.match(name):
                found.add(name)
    return found


def _shell_reads(source: str) -> set[str]:
    lines = [line for line in source.splitlines() if not line.lstrip().startswith("#")]
    return set(SHELL_READ.findall("\n".join(lines)))


def code_reads() -> dict[str, set[str]]:
    """Every ``ODC_*`` variable the code reads -> the files that read it."""
    where: dict[str, set[str]] = {}
    tops = [
        ROOT / "torch_odc",
        ROOT / "benchmarks",
        ROOT / ".ci",
        ROOT / "csrc",
        ROOT / "setup.py",
        ROOT / "CMakeLists.txt",
        ROOT / "tests" / "multiproc.py",  # the test harness's knob (ODC_TEST_FRESH_RANKS)
    ]
    for top in tops:
        for path in _files(top):
            rel = str(path.relative_to(ROOT))
            if path.suffix == ".py":
                names = _python_reads(path.read_text(), rel)
            elif path.suffix in CPP_SUFFIXES:
                names = set(CPP_READ.findall(path.read_text(errors="replace")))
            elif path.name == "CMakeLists.txt" or path.suffix == ".cmake":
                names = set(CMAKE_READ.findall(path.read_text()))
            elif _is_shell(path):
                names = _shell_reads(path.read_text(errors="replace"))
            else:
                continue
            for name in names:
                where.setdefault(name, set()).add(rel)
    return where


# ---------------------------------------------------------------------------------------------
# What the page says


def doc_tables() -> list[tuple[str, str, list[list[str]]]]:
    """The page's table rows: (## section, ### subsection or "", cells) for every row below a
    header (the separator row left out)."""
    rows, section, sub, in_table, fence = [], "", "", False, False
    for line in DOC.read_text().splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        if line.startswith("## "):
            section, sub = line[3:].strip(), ""
        elif line.startswith("### "):
            sub = line[4:].strip()
        if not line.startswith("|"):
            in_table = False
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not in_table:  # the header row
            in_table = True
            continue
        if all(set(c) <= set("-: ") for c in cells):
            continue
        rows.append((section, sub, cells))
    return rows


def _ticked(cell: str) -> str:
    m = re.fullmatch(r"`([^`]+)`", cell)
    assert m, f"docs/configuration.md: first cell {cell!r} is not one `name`"
    return m.group(1)


def doc_env() -> set[str]:
    names = set()
    for section, _, cells in doc_tables():
        if section == "Environment variables":
            name = _ticked(cells[0])
            assert ENV_NAME.match(name), name
            names.add(name)
    return names


def doc_fields(subsection: str) -> dict[str, list[str]]:
    """A config table: field -> its cells."""
    out = {}
    for _, sub, cells in doc_tables():
        if sub == subsection:
            name = _ticked(cells[0])
            assert name not in out, f"{subsection}: {name} listed twice"
            out[name] = cells
    assert out, f"docs/configuration.md has no table under ### {subsection}"
    return out


def doc_api() -> dict[str, dict[str, list[str]]]:
    """The API table: function -> argument -> its cells ({} for a function without any)."""
    out: dict[str, dict[str, list[str]]] = {}
    for section, _, cells in doc_tables():
        if section != "Python API arguments":
            continue
        args = out.setdefault(_ticked(cells[0]), {})
        if cells[1] != "—":
            args[_ticked(cells[1])] = cells
    return out


def _default_text(value) -> str:
    """A default as the page writes it: `"tokens"`, `True`, `None`, `{}`."""
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


# ---------------------------------------------------------------------------------------------
# The tests


def test_every_odc_variable_the_code_reads_is_documented_and_no_other():
    reads = code_reads()
    # The scanner itself: the variables of each language it must find.
    for known in (
        "ODC_CUDA_COLLECTIVES",
        "ODC_HOST_ID",  # Python, torch_odc/
        "ODC_CUDA_CTAS",
        "ODC_CUDA_PUSH",  # C++, csrc/
        "ODC_FORCE_CPU",  # setup.py
        "ODC_TORCH",
    ):  # shell, .ci/bootstrap
        assert known in reads, f"the scan found no read of {known}: {sorted(reads)}"
    documented = doc_env()
    missing = {name: sorted(files) for name, files in reads.items() if name not in documented}
    assert not missing, (
        "read by the code but not in docs/configuration.md's environment tables (add a row: "
        f"values, default, effect): {missing}"
    )
    stale = sorted(documented - set(reads))
    assert not stale, f"docs/configuration.md lists variables nothing reads any more: {stale}"


def test_python_scanner_finds_reads_in_every_form():
    src = (
        "import os\nfrom os import environ, getenv\n_NAME = 'ODC_G'\n"
        "os.environ.get('ODC_A')\nos.environ['ODC_B']\nos.getenv('ODC_C', '1')\n"
        "'ODC_D' in os.environ\nos.environ.setdefault('ODC_E', '')\ngetenv('ODC_F')\n"
        "environ.get(_NAME)\nos.environ.get('OTHER')\nprint('ODC_H')\n"
    )
    assert _python_reads(src, "<test>") == {f"ODC_{c}" for c in "ABCDEFG"}
    assert _shell_reads('# ${ODC_X}\nx="${ODC_Y:-1}"; echo $ODC_Z\nODC_W=1 run\n') == {
        "ODC_Y",
        "ODC_Z",
    }


def _check_fields(subsection: str, fields: dict[str, object]):
    table = doc_fields(subsection)
    missing = sorted(set(fields) - set(table))
    assert not missing, f"docs/configuration.md, {subsection}: fields not documented: {missing}"
    stale = sorted(set(table) - set(fields))
    assert not stale, f"docs/configuration.md, {subsection}: no such fields: {stale}"
    for name, default in fields.items():
        cells = table[name]
        assert len(cells) == 4, f"{subsection}.{name}: expected field | type | default | effect"
        assert cells[2].startswith(_default_text(default)), (
            f"{subsection}.{name}: the code's default is {default!r}, the page says {cells[2]!r}"
        )


def _dataclass_defaults(cls, exclude=()) -> dict[str, object]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in exclude:
            continue
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
        else:
            raise AssertionError(f"{cls.__name__}.{f.name} has no default")
    return out


def test_odc_config_and_odc_grpo_config_fields_are_documented():
    from torch_odc.integrations.hf import ODCConfig, ODCGRPOConfig

    base = _dataclass_defaults(ODCConfig)
    _check_fields("`ODCConfig`", base)
    _check_fields("`ODCGRPOConfig`", _dataclass_defaults(ODCGRPOConfig, exclude=base))


def test_odc_engine_config_fields_are_documented():
    """ODCEngineConfig's own fields (its base is verl's FSDPEngineConfig, whose fields keep
    verl's meaning), read from the source: importing it needs verl."""
    path = ROOT / "torch_odc" / "integrations" / "verl" / "_engine.py"
    tree = ast.parse(path.read_text(), str(path))
    (cls,) = [
        n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == "ODCEngineConfig"
    ]
    fields = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if "ClassVar" in ast.unparse(node.annotation):
                continue
            assert node.value is not None, f"ODCEngineConfig.{node.target.id} has no default"
            fields[node.target.id] = ast.literal_eval(node.value)
    assert fields, "found no field of ODCEngineConfig"
    _check_fields("`ODCEngineConfig`", fields)


def test_api_arguments_are_documented():
    import torch_odc
    from torch_odc import balance

    functions = {
        "torch_odc.attach": torch_odc.attach,
        "torch_odc.minibatch_barrier": torch_odc.minibatch_barrier,
        "torch_odc.release_memory": torch_odc.release_memory,
        "torch_odc.restore_memory": torch_odc.restore_memory,
        "torch_odc.free_gradient_memory": torch_odc.free_gradient_memory,
        "torch_odc.restore_gradient_memory": torch_odc.restore_gradient_memory,
        "torch_odc.balance.plan": balance.plan,
    }
    table = doc_api()
    assert sorted(table) == sorted(functions), (
        f"the API table covers {sorted(table)}, expected {sorted(functions)}"
    )
    for qualname, fn in functions.items():
        params = {}
        for p in inspect.signature(fn).parameters.values():
            name = {p.VAR_KEYWORD: f"**{p.name}", p.VAR_POSITIONAL: f"*{p.name}"}.get(
                p.kind, p.name
            )
            params[name] = p
        documented = table[qualname]
        assert sorted(documented) == sorted(params), (
            f"{qualname}: the page lists {sorted(documented)}, the function takes {sorted(params)}"
        )
        for name, p in params.items():
            cells = documented[name]
            assert len(cells) == 5, (
                f"{qualname}({name}): function | argument | type | default | effect"
            )
            if p.kind in (p.VAR_KEYWORD, p.VAR_POSITIONAL):
                continue
            if p.kind == p.KEYWORD_ONLY:
                assert "keyword only" in cells[2], f"{qualname}({name}) is keyword-only"
            want = "required" if p.default is p.empty else _default_text(p.default)
            assert cells[3].startswith(want), (
                f"{qualname}({name}): the code's default is {want}, the page says {cells[3]!r}"
            )
