"""The machinery of the integrations' compatibility manifests (``hf/_compat.py``,
``verl/_compat.py``): what an adapter needs of a framework beyond its public API, one
:class:`Entry` per name, each with the release it was read in.

A manifest answers three questions:

* :meth:`Manifest.check` -- which entries the installed packages lack (the CPU test, CI);
* :meth:`Manifest.require` -- the same for one adapter's entries, raised as
  :class:`UnsupportedVersion` (a ``ValueError``) naming every missing symbol, the installed
  version and the version it was verified with: adapters call it first in their constructor, so
  an unsupported release is refused before anything runs, never with an ``AttributeError``
  mid-step;
* :meth:`Manifest.read` / :meth:`~Manifest.write` / :meth:`~Manifest.call` /
  :meth:`~Manifest.load` -- how adapters reach the listed names: an unlisted name is a
  ``KeyError`` (a bug in the adapter, caught by the tests); a listed one that is gone raises
  :class:`UnsupportedVersion`.

How each kind is checked against the installed package (nothing is constructed):

========================  ========================================================================
kind                      check
========================  ========================================================================
method overridden         the owner class has a callable of that name taking ``params``
method called             the same (the adapter calls it)
method reproduced         the same (the adapter recomputes what it computes, read in ``version``)
instance attribute        the source of the owner class (or one of its bases of the same package)
                          assigns ``self.<name>``
read by the package       the owner's source mentions the name (a marker the adapter sets)
function imported         the module has a callable of that name taking ``params``
class imported            the module has a class of that name
constant imported         the module has an attribute of that name
module imported           the module imports
dataclass field           the owner dataclass has a field of that name
========================  ========================================================================
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from collections.abc import Iterable
from importlib import metadata

__all__ = ["KINDS", "Entry", "Manifest", "Missing", "Pin", "UnsupportedVersion"]

OVERRIDE = "method overridden"
METHOD = "method called"
REPRODUCED = "method reproduced"
INSTANCE = "instance attribute"
READ_BY = "read by the package"
FUNCTION = "function imported"
CLASS = "class imported"
CONSTANT = "constant imported"
MODULE = "module imported"
FIELD = "dataclass field"
KINDS = (OVERRIDE, METHOD, REPRODUCED, INSTANCE, READ_BY, FUNCTION, CLASS, CONSTANT, MODULE, FIELD)
_CALLABLE = (OVERRIDE, METHOD, REPRODUCED, FUNCTION)
_ON_MODULE = (FUNCTION, CLASS, CONSTANT, MODULE)

_NOT_GIVEN = object()


class UnsupportedVersion(ValueError):
    """An installed framework lacks what an adapter needs (names, versions in the message)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """One name an adapter needs.

    Attributes:
        package: the distribution that provides it (``transformers``, ``trl``, ``verl``, ...).
        owner: the dotted path of the class or module it belongs to, as the adapter reaches it
            (``transformers.Trainer``, ``transformers.trainer``).
        name: the name itself.
        kind: one of :data:`KINDS` (how the adapter uses it, how it is checked).
        version: the release of ``package`` it was read in.
        why: what the adapter needs it for.
        users: the adapters that need it (:meth:`Manifest.require` takes these names).
        params: parameters the adapter passes by name (or, for an override, that the override
            mirrors): each must be in the installed signature.
    """

    package: str
    owner: str
    name: str
    kind: str
    version: str
    why: str
    users: tuple[str, ...]
    params: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"manifest entry {self.symbol}: unknown kind {self.kind!r}")

    @property
    def symbol(self) -> str:
        """The dotted name, e.g. ``transformers.Trainer._save_checkpoint``."""
        return f"{self.owner}.{self.name}"


@dataclasses.dataclass(frozen=True)
class Pin:
    """A release line an adapter is verified against only (its code reproduces the package's
    computation of that line): any other installed version is refused."""

    package: str
    prefix: str  # e.g. "1.16." for every 1.16.x
    why: str
    users: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class Missing:
    """An entry (or pin) the installed packages do not satisfy."""

    entry: Entry | Pin
    installed: str | None  # the installed version of the entry's package, None if absent
    reason: str

    def describe(self) -> str:
        e = self.entry
        have = f"{e.package} {self.installed}" if self.installed else f"{e.package} (not installed)"
        if isinstance(e, Pin):
            return (
                f"{have}: the adapter is verified with {e.package} {e.prefix}x only "
                f"({e.why}); install {e.package}=={e.prefix}*"
            )
        return (
            f"{e.symbol} ({e.kind}) is missing in {have}: {self.reason}; read and "
            f"verified in {e.package} {e.version}, where the adapter uses it: {e.why}"
        )


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def resolve(path: str):
    """The object at dotted ``path``: the longest importable module prefix, then attributes.
    Raises LookupError naming the part that is missing; ModuleNotFoundError when not even the
    top module imports (the package is not installed), and any other ImportError as raised."""
    parts = path.split(".")
    obj, at, first = None, 0, None
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            # This prefix (or a parent of it) is not a module: try a shorter one. A module that
            # exists but fails to import a dependency raises as it is.
            if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
                raise
            first = first or e
            continue
        at = i
        break
    if obj is None:
        raise first
    for part in parts[at:]:
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise LookupError(f"{'.'.join(parts[:at])} has no {part}") from None
        at += 1
    return obj


_SOURCES: dict[int, str] = {}


def _source(obj) -> str:
    key = id(obj)
    if key not in _SOURCES:
        try:
            _SOURCES[key] = inspect.getsource(obj)
        except (OSError, TypeError):
            _SOURCES[key] = ""
    return _SOURCES[key]


def _package_classes(cls: type, package: str) -> list[type]:
    """``cls`` and its bases defined in ``package`` (the import name of its top module)."""
    top = package.replace("-", "_")
    return [c for c in cls.__mro__ if c.__module__.split(".")[0] == top]


def _assigns(cls: type, package: str, name: str) -> bool:
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(?::[^=\n]*)?[-+*/|&]?=(?!=)")
    return any(pattern.search(_source(c)) for c in _package_classes(cls, package))


def _instance_of(obj, owner: str) -> bool:
    try:
        cls = resolve(owner)
    except (LookupError, ImportError):
        return False
    return isinstance(cls, type) and isinstance(obj, cls)


def _missing_params(fn, params: tuple[str, ...]) -> list[str]:
    if not params:
        return []
    try:
        names = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return []  # builtins without a signature: existence is what can be checked
    return [p for p in params if p not in names]


def _problem(entry: Entry) -> str | None:
    """Why the installed package does not provide ``entry``, or None."""
    if entry.kind == MODULE:
        try:
            importlib.import_module(entry.symbol)
        except ImportError as e:
            return f"module {entry.symbol} does not import ({e})"
        return None
    try:
        owner = resolve(entry.owner)
    except (LookupError, ImportError) as e:
        return str(e)
    kind, name = entry.kind, entry.name
    if kind == INSTANCE:
        if not isinstance(owner, type):
            return f"{entry.owner} is not a class"
        if not _assigns(owner, entry.package, name):
            return f"{entry.owner} no longer sets self.{name}"
        return None
    if kind == READ_BY:
        return None if name in _source(owner) else f"{entry.owner} no longer reads {name}"
    if kind == FIELD:
        if not dataclasses.is_dataclass(owner):
            return f"{entry.owner} is not a dataclass"
        fields = {f.name for f in dataclasses.fields(owner)}
        return None if name in fields else f"{entry.owner} has no field {name}"
    try:
        obj = getattr(owner, name)
    except AttributeError:
        return f"{entry.owner} has no {name}"
    if kind in _CALLABLE and not callable(obj):
        return f"{entry.symbol} is not callable"
    if kind == CLASS and not isinstance(obj, type):
        return f"{entry.symbol} is not a class"
    gone = _missing_params(obj, entry.params)
    if gone:
        return f"{entry.symbol} takes no parameter {', '.join(gone)}"
    return None


class Manifest:
    """The entries and pins of one integration (``where`` prefixes its messages)."""

    def __init__(self, where: str, entries: Iterable[Entry], pins: Iterable[Pin] = ()):
        self.where = where
        self.entries: tuple[Entry, ...] = tuple(entries)
        self.pins: tuple[Pin, ...] = tuple(pins)
        seen = set()
        for e in self.entries:
            key = (e.owner, e.name)
            if key in seen:
                raise ValueError(f"{where}: manifest entry {e.symbol} listed twice")
            seen.add(key)
        self.packages: tuple[str, ...] = tuple(dict.fromkeys(e.package for e in self.entries))
        self._lookups: dict = {}

    # -- checking ----------------------------------------------------------------------------

    def _selected(self, packages, users):
        packages = (
            None if packages is None else {packages} if isinstance(packages, str) else set(packages)
        )
        users = None if users is None else {users} if isinstance(users, str) else set(users)
        entries = [
            e
            for e in self.entries
            if (packages is None or e.package in packages)
            and (users is None or users & set(e.users))
        ]
        pins = [
            p
            for p in self.pins
            if (packages is None or p.package in packages)
            and (users is None or users & set(p.users))
        ]
        return entries, pins

    def check(
        self,
        packages: str | Iterable[str] | None = None,
        *,
        users: str | Iterable[str] | None = None,
    ) -> list[Missing]:
        """The entries (of ``packages`` / ``users``, default all) and pins the installed
        packages do not satisfy; empty when everything is there."""
        entries, pins = self._selected(packages, users)
        out = []
        for pin in pins:
            have = installed_version(pin.package)
            if have is None or not have.startswith(pin.prefix):
                out.append(
                    Missing(
                        pin, have, f"{pin.package} {have or '(not installed)'} is not {pin.prefix}x"
                    )
                )
        versions = {}
        for entry in entries:
            if entry.package not in versions:
                versions[entry.package] = installed_version(entry.package)
            have = versions[entry.package]
            if have is None:
                out.append(Missing(entry, None, f"{entry.package} is not installed"))
                continue
            problem = _problem(entry)
            if problem is not None:
                out.append(Missing(entry, have, problem))
        return out

    def require(self, users: str | Iterable[str], where: str | None = None) -> None:
        """Raises :class:`UnsupportedVersion` naming everything of ``users``' entries and pins
        that the installed packages lack (each symbol, the installed version, the version it
        was verified with)."""
        missing = self.check(users=users)
        if missing:
            raise self.error(missing, where)

    def error(self, missing: list[Missing], where: str | None = None) -> UnsupportedVersion:
        where = where or self.where
        lines = "\n".join(f"  - {m.describe()}" for m in missing)
        versions = ", ".join(
            sorted(
                {
                    f"{m.entry.package}=="
                    + (m.entry.version if isinstance(m.entry, Entry) else m.entry.prefix + "*")
                    for m in missing
                }
            )
        )
        return UnsupportedVersion(
            f"{where}: the installed release is not supported: it lacks what the adapter "
            f"uses (listed in its compatibility manifest, {self._module()}):\n{lines}\n"
            f"Install the verified release ({versions}) or update the adapter and its manifest."
        )

    def _module(self) -> str:
        return {
            "torch_odc.integrations.hf": "torch_odc/integrations/hf/_compat.py",
            "torch_odc.integrations.verl": "torch_odc/integrations/verl/_compat.py",
        }.get(self.where, "its _compat module")

    # -- access --------------------------------------------------------------------------------

    def _entry(
        self, kinds: tuple[str, ...], name: str, obj=None, owner: str | None = None
    ) -> Entry:
        """The listed entry of one of ``kinds`` called ``name`` (of ``owner``, or whose owner
        class ``obj`` is an instance of). KeyError when none is listed: the adapter reaches a
        name its manifest does not list."""
        key = (kinds, name, owner, type(obj) if obj is not None else None)
        found = self._lookups.get(key)
        if found is not None:
            return found
        candidates = [
            e
            for e in self.entries
            if e.kind in kinds and e.name == name and (owner is None or e.owner == owner)
        ]
        if obj is not None:  # an attribute of the owner class: the entry whose class obj is
            markers = [e for e in candidates if e.kind == READ_BY]
            candidates = [
                e for e in candidates if e.kind != READ_BY and _instance_of(obj, e.owner)
            ] + markers
        if not candidates:
            where = f"{owner}." if owner else (f"{type(obj).__name__}." if obj is not None else "")
            raise KeyError(
                f"{self.where}: {where}{name} ({'/'.join(kinds)}) is not in the "
                "compatibility manifest"
            )
        self._lookups[key] = candidates[0]
        return candidates[0]

    def _gone(self, entry: Entry, reason: str | None = None) -> UnsupportedVersion:
        have = installed_version(entry.package)
        return self.error([Missing(entry, have, reason or _problem(entry) or "missing")])

    def read(self, obj, name: str, default=_NOT_GIVEN):
        """``obj.<name>`` for a listed instance attribute; ``default`` when ``obj`` has none
        and a default is given, else :class:`UnsupportedVersion`."""
        entry = self._entry((INSTANCE,), name, obj)
        try:
            return getattr(obj, name)
        except AttributeError:
            if default is not _NOT_GIVEN:
                return default
            raise self._gone(entry, f"{type(obj).__name__} has no attribute {name}") from None

    def write(self, obj, name: str, value) -> None:
        """Sets a listed instance attribute, or a listed marker the package reads."""
        self._entry((INSTANCE, READ_BY), name, obj)
        setattr(obj, name, value)

    def call(self, obj, name: str, *args, **kwargs):
        """Calls a listed method of ``obj``."""
        entry = self._entry((METHOD, REPRODUCED), name, obj)
        try:
            method = getattr(obj, name)
        except AttributeError:
            raise self._gone(entry) from None
        return method(*args, **kwargs)

    def load(self, owner: str, name: str):
        """A listed function, class, constant or module of module ``owner``. A package that is
        not installed raises its ModuleNotFoundError, as an import would."""
        entry = self._entry(_ON_MODULE, name, owner=owner)
        try:
            return getattr(resolve(owner), name) if entry.kind != MODULE else resolve(entry.symbol)
        except (LookupError, AttributeError):
            raise self._gone(entry) from None

    def summary(self) -> dict[str, int]:
        """Entries per package."""
        out: dict[str, int] = {}
        for e in self.entries:
            out[e.package] = out.get(e.package, 0) + 1
        return out
