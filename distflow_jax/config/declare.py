"""How a config key is declared, and what is built from the declarations.

Every key is a field of a frozen dataclass in ``config/sections.py``: its type, its default,
a one-line doc, whether a first run needs it (``core``) and its own check, side by side.
From those classes come

- ``to_configdict``: the ml_collections config every config file starts from
  (``defaults.base()``); ml_collections and ``--config.x=`` overrides stay the interface;
- ``view``: the typed, frozen view of a loaded config (built once, after the overrides);
- ``entries``: every key with its type, default, doc and check (``config --keys``);
- ``check_fields``: every declared check run on a loaded config.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import ml_collections

Check = Callable[[Any, str], None]


@dataclasses.dataclass(frozen=True)
class KeyInfo:
  """What a declaration says besides its default."""
  doc: str
  core: bool = False        # a key a first run sets: `config --keys` shows these first
  check: Check | None = None  # called with (value, dotted key); raises ConfigError


def key(default: Any, doc: str, *, core: bool = False, check: Check | None = None) -> Any:
  """A leaf key: its default, one-line doc and check."""
  return dataclasses.field(default=default, metadata={"info": KeyInfo(doc, core, check)})


def section(factory: Callable[[], Any], doc: str, *, core: bool = False) -> Any:
  """A sub-section: ``factory()`` makes its declared default (a section dataclass)."""
  return dataclasses.field(default_factory=factory, metadata={"info": KeyInfo(doc, core)})


def open_key(default: Callable[[], Any], doc: str, *, core: bool = False) -> Any:
  """A key whose inner contents the schema does not fix (the DAG), checked by its own code."""
  return dataclasses.field(default_factory=default, metadata={"info": KeyInfo(doc, core),
                                                               "open": True})


class Section:
  """The base of every declared section: its fields read as attributes (``cfg.rollout.n``),
  by name (``cfg["rollout"]``, for a name held in a variable) and as a plain dict
  (``to_dict()``), as a loaded ml_collections config's do."""

  def __getitem__(self, name: str) -> Any:
    if name not in self.__dataclass_fields__:  # type: ignore[attr-defined]
      raise KeyError(name)
    return getattr(self, name)

  def __contains__(self, name: str) -> bool:
    return name in self.__dataclass_fields__  # type: ignore[attr-defined]

  def to_dict(self) -> dict[str, Any]:
    return _plain(self)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One declared key, as ``config --keys`` lists it."""
  key: str
  type: str
  default: Any
  info: KeyInfo
  is_section: bool


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
  return typing.get_type_hints(cls)


def _section_class(cls: type, name: str) -> type | None:
  hint = _hints(cls)[name]
  return hint if dataclasses.is_dataclass(hint) else None


def entries(obj: Any, prefix: str = "") -> Iterator[Entry]:
  """Every key of the section instance ``obj`` (its values as defaults: the critic's
  optimizer and each placement's mesh have their own), depth first in declaration order,
  a section before its keys."""
  cls = type(obj)
  for f in dataclasses.fields(cls):
    name = prefix + f.name
    info: KeyInfo = f.metadata["info"]
    value = getattr(obj, f.name)
    if _section_class(cls, f.name) is not None:
      yield Entry(name, "section", None, info, True)
      yield from entries(value, name + ".")
    else:
      yield Entry(name, _type_name(_hints(cls)[f.name]), value, info, False)


def _type_name(hint: Any) -> str:
  return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _plain(value: Any) -> Any:
  if dataclasses.is_dataclass(value):
    return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
  return value


def to_configdict(obj: Any) -> ml_collections.ConfigDict:
  """The ml_collections config holding ``obj``'s values (sections as nested ConfigDicts)."""
  return ml_collections.ConfigDict(_plain(obj))


def view(cls: type, cfg: Mapping[str, Any]) -> Any:
  """The typed, frozen view of ``cfg`` (a loaded ConfigDict, or its section), as ``cls``.
  Tuples stay tuples, an open key's contents are kept as they are."""
  if hasattr(cls, "from_config"):  # a section a config may give in part (schema.PARTIAL)
    return cls.from_config(cfg)
  kwargs = {}
  for f in dataclasses.fields(cls):
    value = cfg[f.name]
    sub = _section_class(cls, f.name)
    kwargs[f.name] = view(sub, value) if sub is not None else _frozen(value, f)
  return cls(**kwargs)


def replaced(obj: Any, overrides: Mapping[str, Any]) -> Any:
  """The section instance ``obj`` with ``overrides`` (a DAG node's ``config=``: nested dicts
  patch nested sections) applied as ml_collections applies them: ints widen to floats, an
  unknown key or a wrong type is refused (config/checks.py names the node first)."""
  merged = to_configdict(obj)
  merged.lock()  # a key the section lacks is refused, not added
  merged.update(dict(overrides))
  return view(type(obj), merged)


def nested(dotted: Mapping[str, Any]) -> dict[str, Any]:
  """``{"a.b": 1, "a.c": 2}`` as ``{"a": {"b": 1, "c": 2}}``."""
  out: dict[str, Any] = {}
  for key_, value in dotted.items():
    *parents, leaf = key_.split(".")
    node = out
    for p in parents:
      node = node.setdefault(p, {})
    node[leaf] = value
  return out


def _frozen(value: Any, f: dataclasses.Field) -> Any:
  if isinstance(value, list) and not f.metadata.get("open"):
    return tuple(value)
  if isinstance(value, ml_collections.ConfigDict):
    return value.to_dict()
  return value


def check_fields(cls: type, cfg: Mapping[str, Any], prefix: str = "") -> None:
  """Runs every declared check on ``cfg``'s values, in declaration order."""
  for f in dataclasses.fields(cls):
    name = prefix + f.name
    sub = _section_class(cls, f.name)
    if sub is not None and f.name in cfg:  # a partial section's own code checks the rest
      check_fields(sub, cfg[f.name], name + ".")
    elif sub is None and f.metadata["info"].check is not None:
      f.metadata["info"].check(cfg[f.name], name)
