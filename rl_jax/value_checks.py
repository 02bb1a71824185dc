"""Value checks: predicates that take one value and return None when it is fine, or the
requirement it violates (``"must be a positive int"``).

The config tree applies them by dotted key (``rl_jax.config_checks.check``, which turns a
requirement into one ``ConfigError`` line naming the key); the loss knobs carry theirs
(``rl_jax.losses.KNOBS``), so one declaration gives a knob's type, default, range and meaning
to both the config and ``losses.get_objective``. No dependencies: any layer may import this.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Iterable

__all__ = ["Check", "is_int", "is_number", "positive_int", "power_of_two", "nonnegative_int",
           "positive", "nonnegative", "probability", "in_range", "one_of", "optional"]


# A check takes a value and returns None when it is fine, or a requirement it violates
# (e.g. "must be a positive int"), which `check` turns into a ConfigError naming the key.
Check = Callable[[Any], "str | None"]


def is_int(x: Any) -> bool:
  """An integer (a Python or NumPy one) that is not a bool."""
  return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def is_number(x: Any) -> bool:
  """A real number (a Python or NumPy int or float) that is not a bool."""
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


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
