"""Dotted-key lookup and declarative value checks for ml-collections configs.

Validation is declarative: ``check(config, "rollout.top_p", probability)`` or
``validate(config, {"train.steps": positive_int, "loss.preset": one_of(...)})``. Each check is
a predicate that returns ``None`` when the value is fine or a short requirement such as
``"must be in [0, 1]"``, which ``check`` turns into one ``ConfigError`` line naming the key::

    config.rollout.top_p must be a number in [0, 1], got 1.5

Everything here is also importable from ``rl_jax.config_utils``.
"""

from __future__ import annotations

import difflib
import math
from typing import Any, Callable, Iterable, Mapping, Sequence

import ml_collections
from ml_collections import config_dict

from rl_jax.errors import ConfigError

__all__ = [
    "get_value", "Check", "check", "check_choice", "validate",
    "positive_int", "power_of_two", "nonnegative_int", "positive", "nonnegative", "probability",
    "in_range", "one_of", "optional",
]


# ------------------------------------------------------------------ dotted keys
def _child_names(node: Any) -> list[str]:
  return sorted(str(k) for k in node.keys()) if isinstance(node, ml_collections.ConfigDict) else []


def _unknown_key(key: str, parent_path: str, parent: Any) -> ConfigError:
  names = _child_names(parent)
  leaf = key.split(".")[-1]
  close = difflib.get_close_matches(leaf, names, n=1)
  hint = f"; did you mean {'.'.join(filter(None, [parent_path, close[0]]))!r}?" if close else ""
  where = f"config.{parent_path}" if parent_path else "config"
  return ConfigError(f"unknown config key {key!r} ({where} has: {', '.join(names)}){hint}")


def resolve_parent(config: ml_collections.ConfigDict,
                   key: str) -> tuple[ml_collections.ConfigDict, str]:
  """The ConfigDict holding ``key``'s last component, and that component.

  Raises:
    ConfigError: a component of ``key`` does not exist (with a did-you-mean hint).
  """
  parts = key.split(".")
  node = config
  for i, part in enumerate(parts[:-1]):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise _unknown_key(key, ".".join(parts[:i]), node)
    node = node[part]
  if not isinstance(node, ml_collections.ConfigDict) or parts[-1] not in node:
    raise _unknown_key(key, ".".join(parts[:-1]), node)
  return node, parts[-1]


def get_value(config: ml_collections.ConfigDict, key: str) -> Any:
  """``config`` at dotted ``key`` (``"rollout.top_p"``); ConfigError naming it if absent."""
  parent, leaf = resolve_parent(config, key)
  return parent[leaf]


# ------------------------------------------------------------------ checks
# A check takes a value and returns None when it is fine, or a requirement it violates
# (e.g. "must be a positive int"), which `check` turns into a ConfigError naming the key.
Check = Callable[[Any], "str | None"]


def is_int(x: Any) -> bool:
  """An int that is not a bool."""
  return isinstance(x, int) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
  """An int or float that is not a bool."""
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def positive_int(x: Any) -> str | None:
  """Requires an int > 0."""
  return None if is_int(x) and x > 0 else "must be a positive int"


def power_of_two(x: Any) -> str | None:
  """Requires an int that is a positive power of two."""
  return None if is_int(x) and x > 0 and not x & (x - 1) else "must be a positive power of two"


def nonnegative_int(x: Any) -> str | None:
  """Requires an int >= 0."""
  return None if is_int(x) and x >= 0 else "must be an int >= 0"


def positive(x: Any) -> str | None:
  """Requires a finite number > 0."""
  return None if is_number(x) and math.isfinite(x) and x > 0 else "must be a number > 0"


def nonnegative(x: Any) -> str | None:
  """Requires a finite number >= 0."""
  return None if is_number(x) and math.isfinite(x) and x >= 0 else "must be a number >= 0"


def probability(x: Any) -> str | None:
  """Requires a number in [0, 1]."""
  return None if is_number(x) and 0 <= x <= 1 else "must be a number in [0, 1]"


def in_range(low: float | None = None, high: float | None = None, *,
             low_inclusive: bool = True, high_inclusive: bool = True) -> Check:
  """A check for a number in the interval given (None: unbounded on that side)."""
  left = "[" if low_inclusive else "("
  right = "]" if high_inclusive else ")"
  text = (f"must be a number in {left}{'-inf' if low is None else low}, "
          f"{'inf' if high is None else high}{right}")

  def check_range(x: Any) -> str | None:
    if not is_number(x) or math.isnan(x):
      return text
    if low is not None and (x < low or (x == low and not low_inclusive)):
      return text
    if high is not None and (x > high or (x == high and not high_inclusive)):
      return text
    return None

  return check_range


def one_of(choices: Iterable[Any]) -> Check:
  """A check for membership in ``choices``, read each time the check runs.

  ``choices`` may be any iterable: a tuple, a dict (its keys) or a live view of a registry,
  so a choice added after the check was built (e.g. registered by a user's config file) is
  accepted. A one-shot iterator (a generator) is read once, here.
  """
  if iter(choices) is choices:  # An iterator would be exhausted by the first check.
    choices = tuple(choices)

  def check_choice_(x: Any) -> str | None:
    allowed = list(choices)
    return None if x in allowed else f"must be one of {allowed}"

  return check_choice_


def optional(inner: Check) -> Check:
  """``inner``, but None is also accepted."""

  def check_optional(x: Any) -> str | None:
    return None if x is None else inner(x)

  return check_optional


def check(config: ml_collections.ConfigDict, key: str, *checks: Check) -> Any:
  """Applies ``checks`` to ``config.<key>``; returns the value.

  Raises:
    ConfigError: the key is unknown, or the first failing check, as
      ``"config.rollout.top_p must be a number in [0, 1], got 1.5"``.
  """
  value = get_value(config, key)
  if isinstance(value, config_dict.FieldReference):
    value = value.get()
  for fn in checks:
    problem = fn(value)
    if problem:
      shown = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
      raise ConfigError(f"config.{key} {problem}, got {shown!r}")  # one line
  return value


def check_choice(config: ml_collections.ConfigDict, key: str, choices: Iterable[Any]) -> Any:
  """``check(config, key, one_of(choices))``."""
  return check(config, key, one_of(choices))


def validate(config: ml_collections.ConfigDict,
             schema: Mapping[str, Check | Sequence[Check]]) -> None:
  """Runs ``check`` for every ``key -> check(s)`` in ``schema``; first failure raises."""
  for key, checks in schema.items():
    checks = tuple(checks) if isinstance(checks, (tuple, list)) else (checks,)
    check(config, key, *checks)
