"""The integrations' compatibility manifests (torch_odc/integrations/hf/_compat.py for
transformers, accelerate and TRL; torch_odc/integrations/verl/_compat.py for verl) against the
installed packages, on CPU:

* every listed name exists in the installed release (per package; verl's inside verl's own
  environment, as tests/test_integrations_verl.py runs it);
* a listed symbol deleted from the installed class is reported by ``check()`` and refused when an
  adapter is constructed, with a ValueError naming the symbol, the installed version and the
  version it was verified with (not an AttributeError later): the real ``transformers.Trainer``
  under ``odc_trainer(Trainer)`` on one rank, and verl's ``FSDPEngine`` under the "odc" engine;
* the adapters' source reaches no private name of those packages, and imports nothing from their
  inner modules, except through the manifest.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
import tempfile
from importlib import metadata

import pytest
from verl_env import run_under_verl

from torch_odc.integrations import _manifest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INTEGRATIONS = os.path.join(ROOT, "torch_odc", "integrations")
FRAMEWORKS = ("transformers", "accelerate", "trl", "verl")


def _load_file(name: str, path: str):
    """A manifest module loaded from its file: verl's package imports verl, which this
    environment may not have; the manifest itself imports nothing of it."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def hf_compat():
    return _load_file("odc_hf_compat", os.path.join(INTEGRATIONS, "hf", "_compat.py"))


def verl_compat():
    return _load_file("odc_verl_compat", os.path.join(INTEGRATIONS, "verl", "_compat.py"))


# -- 1. every entry against the installed packages ---------------------------------------------


@pytest.mark.parametrize("package", ["transformers", "accelerate", "trl"])
def test_every_hf_manifest_entry_exists_in_the_installed_package(package):
    pytest.importorskip(package)
    compat = hf_compat()
    entries = [e for e in compat.ENTRIES if e.package == package]
    assert entries, f"no entries for {package}"
    missing = compat.check(package)
    assert not missing, (
        f"{package} {metadata.version(package)} lacks what the HF adapters "
        "use:\n" + "\n".join(m.describe() for m in missing)
    )
    print(f"{package} {metadata.version(package)}: {len(entries)} entries present")


@pytest.fixture(scope="module")
def verl_run(tmp_path_factory):
    """tests/compat_verl_cases.py under verl's python: check(), an engine constructed, and the
    same with FSDPEngine._build_fsdp_module deleted."""
    return run_under_verl(
        "compat_verl_cases.py", tmp_path_factory.mktemp("compat") / "verl.json", timeout=600
    )


def test_every_verl_manifest_entry_exists_in_verls_environment(verl_run):
    assert verl_run["versions"]["verl"] == "0.9.1", verl_run["versions"]
    assert not verl_run["missing"], "\n".join(verl_run["missing"])
    assert verl_run["entries"] == verl_compat().MANIFEST.summary()
    assert verl_run["built"] == {"ok": True, "class": "ODCFSDPEngineWithLMHead", "active": True}, (
        verl_run["built"]
    )


def test_a_deleted_verl_symbol_is_reported_and_refused_at_construction(verl_run):
    deleted = verl_run["deleted"]
    symbol = "verl.workers.engine.fsdp.transformer_impl.FSDPEngine._build_fsdp_module"
    assert deleted["check"] == [symbol], deleted
    refused = deleted["constructed"]
    assert not refused["ok"], refused
    assert "ValueError" in refused["mro"] and "AttributeError" not in refused["mro"], refused
    message = refused["message"]
    version = verl_run["versions"]["verl"]
    assert symbol in message and f"verl {version}" in message, message
    assert "verified in verl 0.9.1" in message and "verl==0.9.1" in message, message
    assert verl_run["restored"] == [], verl_run["restored"]


# -- 2. a deleted symbol: check() reports it, the adapter is refused at construction -----------


def test_check_reports_a_deleted_trainer_method_and_require_names_it(monkeypatch):
    transformers = pytest.importorskip("transformers")
    from torch_odc.integrations.hf import _compat

    installed = metadata.version("transformers")
    symbol = "transformers.Trainer._save_checkpoint"
    monkeypatch.delattr(transformers.Trainer, "_save_checkpoint")
    missing = _compat.check("transformers")
    assert [m.entry.symbol for m in missing] == [symbol]
    assert missing[0].installed == installed
    with pytest.raises(ValueError) as refused:
        _compat.require(("trainer",))
    assert not isinstance(refused.value, AttributeError)
    message = str(refused.value)
    assert symbol in message, message
    assert f"transformers {installed}" in message, message  # the installed version
    assert f"verified in transformers {_compat.TRANSFORMERS}" in message, message
    # Only the adapters that use it are refused: the entry is the core's (every adapter).
    assert all("trainer" in m.entry.users for m in missing)
    monkeypatch.undo()
    assert _compat.check("transformers") == []


def test_a_listed_attribute_missing_on_the_instance_raises_the_manifest_error():
    transformers = pytest.importorskip("transformers")
    from torch_odc.integrations.hf import _compat

    bare = transformers.Trainer.__new__(transformers.Trainer)  # no __init__: no attributes
    with pytest.raises(_compat.UnsupportedVersion, match=r"Trainer\._train_batch_size"):
        _compat.read(bare, "_train_batch_size")
    assert _compat.read(bare, "_loss_shifts_labels", True) is True  # a read with a default
    with pytest.raises(KeyError, match="not in the compatibility manifest"):
        _compat.read(bare, "_not_listed_anywhere")


def test_a_pin_refuses_another_release_naming_both_versions():
    pytest.importorskip("trl")
    installed = metadata.version("trl")
    manifest = _manifest.Manifest("test", [], [_manifest.Pin("trl", "0.0.", "a test pin", ("x",))])
    with pytest.raises(ValueError) as refused:
        manifest.require("x")
    assert f"trl {installed}" in str(refused.value) and "trl==0.0.*" in str(refused.value)
    # The GRPO adapter's TRL pin is the manifest's, and the installed TRL satisfies it.
    from torch_odc.integrations.hf import _compat, grpo

    (pin,) = [p for p in _compat.PINS if "grpo" in p.users]
    assert (pin.package, pin.prefix) == ("trl", grpo.VERIFIED_TRL)
    assert installed.startswith(pin.prefix)


def _construct_after_deleting(rank, world):
    """One rank: odc_trainer(Trainer) on a tiny Llama is built with every listed name present;
    with GRPOTrainer._get_per_token_logps_and_entropies deleted (a GRPO-only entry) too; with
    Trainer._save_checkpoint deleted from the installed class it is refused."""
    from hf_helpers import set_rank_env
    from test_integrations_hf import build_model, collate
    from transformers import Trainer, TrainingArguments

    from torch_odc.integrations.hf import ODCConfig, odc_trainer

    set_rank_env(rank, world, port=29563)

    def build():
        args = TrainingArguments(
            output_dir=tempfile.mkdtemp(prefix="odc-compat-"),
            fsdp=True,
            fsdp_config={"version": 2},
            use_cpu=True,
            report_to=[],
            per_device_train_batch_size=2,
            disable_tqdm=True,
        )
        try:
            trainer = odc_trainer(Trainer)(
                model=build_model(False),
                args=args,
                data_collator=collate,
                train_dataset=[{"input_ids": [2, 3, 4]}] * 4,
                odc=ODCConfig(max_tokens_per_microbatch=16),
            )
        except Exception as e:  # noqa: BLE001 - returned to the test
            return {"ok": False, "mro": [c.__name__ for c in type(e).__mro__], "message": str(e)}
        return {"ok": True, "class": type(trainer).__name__}

    out = {"present": build()}
    import trl

    saved = trl.GRPOTrainer.__dict__["_get_per_token_logps_and_entropies"]
    delattr(trl.GRPOTrainer, "_get_per_token_logps_and_entropies")
    try:
        out["other_adapters_entry"] = build()
    finally:
        trl.GRPOTrainer._get_per_token_logps_and_entropies = saved
    saved = Trainer.__dict__["_save_checkpoint"]
    delattr(Trainer, "_save_checkpoint")
    try:
        out["deleted"] = build()
    finally:
        Trainer._save_checkpoint = saved
    out["restored"] = build()
    return out


def test_constructing_the_adapter_without_a_listed_symbol_is_refused_with_its_name():
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    pytest.importorskip("trl")
    from multiproc import run_ranks

    (out,) = run_ranks(1, _construct_after_deleting, backend="gloo", timeout=300)
    assert out["present"] == {"ok": True, "class": "ODCTrainer"}, out["present"]
    assert out["other_adapters_entry"] == {"ok": True, "class": "ODCTrainer"}, out
    refused = out["deleted"]
    assert not refused["ok"], refused
    assert "ValueError" in refused["mro"] and "AttributeError" not in refused["mro"], refused
    message = refused["message"]
    installed = metadata.version("transformers")
    assert "transformers.Trainer._save_checkpoint" in message, message
    assert f"missing in transformers {installed}" in message, message
    assert "verified in transformers 5.23.0" in message, message
    assert out["restored"] == out["present"], out["restored"]


# -- 3. the adapters reach those names only through the manifest -------------------------------


ADAPTERS = {
    "hf": ("_core.py", "_config.py", "_steps.py", "_checkpoints.py", "sft.py", "dpo.py", "grpo.py"),
    "verl": ("_engine.py", "_cpu.py"),
}
OWN_MODULES = {"torch_odc", "balance", "_compat"}  # torch-odc's own modules


def _private(name: str) -> bool:
    return (
        name.startswith("_")
        and not name.startswith("_odc")
        and not (name.startswith("__") and name.endswith("__"))
    )


def _is_super_call(node) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


class _Scan(ast.NodeVisitor):
    """Private names of other packages reached directly, per adapter file. Inside a class of
    the adapter's own helpers (a name not starting with "ODC"), that class's own private
    attributes and methods are its own; in the ODC mixins, private names other than ``_odc*``
    are the frameworks' and must be manifest overrides (``def``, ``super().<name>``,
    ``self.<name>``: its own override)."""

    def __init__(self, path, overrides, entries):
        self.path, self.overrides, self.entries = path, overrides, entries
        self.problems: list[str] = []
        self.own: list[set[str]] = [set()]
        self.in_odc: list[bool] = [False]

    def problem(self, node, what):
        self.problems.append(f"{os.path.relpath(self.path, ROOT)}:{node.lineno}: {what}")

    def visit_ClassDef(self, node):
        own = set()
        for item in ast.walk(node):
            if isinstance(item, ast.FunctionDef):
                own.add(item.name)
            if (
                isinstance(item, ast.Attribute)
                and isinstance(item.ctx, ast.Store)
                and isinstance(item.value, ast.Name)
                and item.value.id == "self"
            ):
                own.add(item.attr)
        odc = node.name.startswith("ODC")
        if odc:
            for item in node.body:
                if (
                    isinstance(item, ast.FunctionDef)
                    and _private(item.name)
                    and item.name not in self.overrides
                ):
                    self.problem(
                        item,
                        f"{node.name}.{item.name} overrides a private name that "
                        "is not a manifest override (rename it _odc_*, or list "
                        "it)",
                    )
        self.own.append(set() if odc else own)
        self.in_odc.append(odc)
        self.generic_visit(node)
        self.own.pop()
        self.in_odc.pop()

    def visit_Attribute(self, node):
        name, base = node.attr, node.value
        if _private(name):
            own_module = isinstance(base, ast.Name) and base.id in OWN_MODULES
            own_attr = name in self.own[-1]
            override = name in self.overrides and (
                _is_super_call(base) or (isinstance(base, ast.Name) and base.id == "self")
            )
            if not (own_module or own_attr or override):
                self.problem(
                    node,
                    f"{ast.unparse(node)}: a private name reached directly "
                    "(list it in _compat and use _compat.read/write/call)",
                )
        self.generic_visit(node)

    def visit_Call(self, node):
        func = node.func
        if (
            isinstance(func, ast.Name)
            and func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) > 1
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _private(node.args[1].value)
        ):
            self.problem(node, f"{ast.unparse(node)}: a private name reached directly")
        if (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "_compat"
        ):
            consts = [a.value for a in node.args if isinstance(a, ast.Constant)]
            if func.attr == "load" and len(consts) == 2:
                if tuple(consts) not in self.entries:
                    self.problem(node, f"_compat.load{tuple(consts)}: not in the manifest")
            elif (
                func.attr in ("read", "write", "call")
                and consts
                and not any(name == consts[0] for _, name in self.entries)
            ):
                self.problem(node, f"_compat.{func.attr}(..., {consts[0]!r}): not in the manifest")
        self.generic_visit(node)

    def visit_ImportFrom(self, node):
        module = node.module or ""
        if node.level == 0 and module.split(".")[0] in FRAMEWORKS and "." in module:
            self.problem(
                node,
                f"from {module} import ...: an inner module of "
                f"{module.split('.')[0]} imported directly (use _compat.load)",
            )
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            if alias.name.split(".")[0] in FRAMEWORKS and "." in alias.name:
                self.problem(node, f"import {alias.name}: use _compat.load")
        self.generic_visit(node)


@pytest.mark.parametrize("integration", sorted(ADAPTERS))
def test_adapters_reach_private_names_only_through_their_manifest(integration):
    compat = hf_compat() if integration == "hf" else verl_compat()
    overrides = {e.name for e in compat.ENTRIES if e.kind == _manifest.OVERRIDE}
    entries = {(e.owner, e.name) for e in compat.ENTRIES}
    problems = []
    for name in ADAPTERS[integration]:
        path = os.path.join(INTEGRATIONS, integration, name)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        scan = _Scan(path, overrides, entries)
        scan.visit(tree)
        problems += scan.problems
    assert not problems, "\n".join(problems)


def test_the_scan_finds_a_direct_private_read():
    """The source check above is not vacuous: a mixin reading a trainer's private attribute,
    importing from an inner module or overriding an unlisted private method is reported."""
    source = (
        "from transformers.trainer import SCHEDULER_NAME\n"
        "class ODCThing:\n"
        "    def _odc_fine(self):\n"
        "        return self._odc_mine, getattr(self, '_odc_x', 0)\n"
        "    def _unlisted(self):\n"
        "        return self._metrics, getattr(self, '_tp_size', 1)\n"
        "class Helper:\n"
        "    def __init__(self):\n"
        "        self._own = 1\n"
        "    def get(self):\n"
        "        return self._own\n"
    )
    scan = _Scan(os.path.join(ROOT, "example.py"), {"_save_checkpoint"}, set())
    scan.visit(ast.parse(source))
    found = "\n".join(scan.problems)
    assert "example.py:1: from transformers.trainer" in found, found
    assert "ODCThing._unlisted" in found and "self._metrics" in found, found
    assert "getattr(self, '_tp_size', 1)" in found, found
    # The adapter's own names (_odc*, a helper class's own attributes) are not reported.
    assert [p.split(":")[1] for p in scan.problems] == ["1", "5", "6", "6"], found


def test_manifest_entries_are_well_formed():
    for compat in (hf_compat(), verl_compat()):
        users = {u for e in compat.ENTRIES for u in e.users}
        for e in compat.ENTRIES:
            assert e.package in (*FRAMEWORKS, "torch"), e
            assert e.owner.split(".")[0] == e.package.replace("-", "_"), e
            assert e.version and e.why and e.users, e
            assert e.kind in _manifest.KINDS, e
        assert users, compat
    hf = hf_compat()
    assert {u for e in hf.ENTRIES for u in e.users} == {"trainer", "sft", "dpo", "grpo"}
    assert {u for e in verl_compat().ENTRIES for u in e.users} == {"engine", "config", "platform"}


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
