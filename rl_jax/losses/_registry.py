"""A small name -> factory registry with a live, read-only view of its names."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Iterator, Mapping

__all__ = ["NameView", "Registry"]


class NameView(Sequence):
  """Read-only sequence of a registry's names, in registration order; always current.

  Supports ``in``, iteration, ``len``, indexing and ``list(...)``; compares equal to a tuple
  or list with the same names in the same order.
  """

  def __init__(self, registry: "Registry"):
    self._registry = registry

  def __getitem__(self, i):
    return tuple(self._registry.names())[i]

  def __len__(self) -> int:
    return len(self._registry.names())

  def __iter__(self) -> Iterator[str]:
    return iter(self._registry.names())

  def __contains__(self, name: object) -> bool:
    return name in self._registry.names()

  def __eq__(self, other: object) -> bool:
    if isinstance(other, (NameView, tuple, list)):
      return tuple(self) == tuple(other)
    return NotImplemented

  def __hash__(self) -> int:
    return hash(tuple(self))

  def __repr__(self) -> str:
    return repr(tuple(self))


class Registry:
  """Maps a name to ``factory(knobs: Mapping[str, Any]) -> part``; ``check`` validates parts."""

  def __init__(self, kind: str, check: Callable[[str, Any], None]):
    self._kind = kind
    self._check = check
    self._factories: dict[str, Callable[[Mapping[str, Any]], Any]] = {}
    self.view = NameView(self)

  def register(self, name: str, factory: Callable[[Mapping[str, Any]], Any], *,
               overwrite: bool = False) -> None:
    if not isinstance(name, str) or not name:
      raise ValueError(f"{self._kind} name must be a non-empty string, got {name!r}")
    if not callable(factory):
      raise ValueError(f"{self._kind} {name!r}: factory must be callable, got "
                       f"{type(factory).__name__}")
    if name in self._factories and not overwrite:
      raise ValueError(f"{self._kind} {name!r} is already registered; pass overwrite=True "
                       "to replace it")
    self._factories[name] = factory

  def names(self) -> tuple[str, ...]:
    return tuple(self._factories)

  def make(self, name: str, knobs: Mapping[str, Any]) -> Any:
    """``factory(knobs)`` for ``name``, checked; ValueError naming the choices if unknown."""
    if name not in self._factories:
      raise ValueError(f"unknown {self._kind} {name!r}; choose one of {list(self._factories)}")
    part = self._factories[name](knobs)
    self._check(name, part)
    return part
