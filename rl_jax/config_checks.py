"""Dotted-key lookup and declarative value checks for ml-collections configs.

Validation is declarative: ``check(config, "rollout.top_p", probability)`` or
``validate(config, {"train.steps": positive_int, "loss.preset": one_of(...)})``. Each check is
a predicate that returns ``None`` when the value is fine or a short requirement such as
``"must be in [0, 1]"``, which ``check`` turns into one ``ConfigError`` line naming the key::

    config.rollout.top_p must be a number in [0, 1], got 1.5

The predicates live in ``rl_jax.value_checks`` (the loss knobs use them too); everything here
is also importable from ``rl_jax.config_utils``.
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Mapping, Sequence

import ml_collections
from ml_collections import config_dict

from rl_jax.errors import ConfigError
from rl_jax.value_checks import (Check, in_range, is_int, is_number, nonnegative,
                                  nonnegative_int, one_of, optional, positive, positive_int,
                                  power_of_two, probability)

__all__ = [
    "get_value", "Check", "check", "check_choice", "validate",
    # the value checks, from rl_jax.value_checks
    "is_int", "is_number", "positive_int", "power_of_two", "nonnegative_int", "positive",
    "nonnegative", "probability", "in_range", "one_of", "optional",
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
