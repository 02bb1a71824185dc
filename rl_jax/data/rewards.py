"""Isolated, time-limited reward computation and DAPO overlong reward shaping.

``compute_rewards`` calls a verifier ``verify_fn(completion, reference) -> float`` once per
row. A verifier that raises, returns a non-finite or non-numeric value, or runs past
``timeout_s`` gives reward 0 and is counted in the returned stats; a run never crashes on a
verifier.

Named reward components: a verifier may return a mapping ``{name: float}`` instead of a float
(e.g. ``{"format": 0.2, "correct": 1.0}``). The row's reward is then the sum of its
components; ``verify_rows`` keeps each row's value as returned and ``stack_components`` turns
the values of a batch into (totals [B], components [B,C]) in the order of the run's component
names (every row must return the same names: one ``RLJaxError`` line otherwise). A failed call
scores 0 on every component.

Isolation modes (``isolation=``):
  signal  SIGALRM interval timer around each call (POSIX, main thread only). Interrupts
          pure-Python work such as sympy inside math-verify at the next bytecode, costs
          nothing per call, and leaves nothing running. Cannot interrupt a single long C call;
          replaces any SIGALRM timer the caller had set.
  thread  each call in a daemon thread joined with a timeout. Works from any thread; a
          verifier that times out is abandoned and keeps running in the background until it
          finishes (Python cannot kill a thread), so it may hold CPU.
  auto    (default) ``signal`` in the main thread on POSIX, otherwise ``thread``.
A process pool would be stronger isolation (killable) but needs picklable verifiers and
costs process start-up plus a sympy import per worker; the verifiers here are pure Python,
which the signal mode bounds.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import threading
import numbers
from typing import Any, Callable, Mapping, Sequence, Union

import numpy as np

from rl_jax.errors import RLJaxError

__all__ = ["RewardValue", "VerifierTimeout", "VerifyFn", "call_isolated", "component_names",
           "compute_rewards", "failure", "note_failures", "overlong_penalty", "reward_value",
           "stack_components", "verify_rows"]

NOTED_FAILURES = 3  # distinct failures of one reward source printed per process

# one row's reward: a number, or named components {name: number} that sum to it
RewardValue = Union[float, Mapping[str, float]]
VerifyFn = Callable[[str, Any], RewardValue]


class VerifierTimeout(BaseException):
  """Raised inside a verifier by the alarm. BaseException, so ``except Exception`` in a
  verifier (math-verify has several) cannot swallow it."""


def _call_with_alarm(fn: Callable[[], float], timeout_s: float) -> float:
  def handler(signum, frame):
    del signum, frame
    raise VerifierTimeout()

  old = signal.signal(signal.SIGALRM, handler)
  signal.setitimer(signal.ITIMER_REAL, timeout_s)
  try:
    return fn()
  finally:
    signal.setitimer(signal.ITIMER_REAL, 0)
    signal.signal(signal.SIGALRM, signal.SIG_DFL if old is None else old)


def _call_in_thread(fn: Callable[[], float], timeout_s: float) -> float:
  box: dict[str, Any] = {}

  def run():
    try:
      box["value"] = fn()
    except BaseException as e:  # re-raised in the caller
      box["error"] = e

  t = threading.Thread(target=run, daemon=True, name="rl_jax-verifier")
  t.start()
  t.join(timeout_s)
  if t.is_alive():
    raise VerifierTimeout()
  if "error" in box:
    raise box["error"]
  return box["value"]


def _resolve_isolation(isolation: str) -> str:
  if isolation not in ("auto", "signal", "thread"):
    raise ValueError(f"unknown isolation {isolation!r}; use 'auto', 'signal' or 'thread'")
  main = threading.current_thread() is threading.main_thread()
  can_signal = os.name == "posix" and main
  if isolation == "signal" and not can_signal:
    raise ValueError("isolation='signal' needs POSIX and the main thread; use 'thread'")
  if isolation == "auto":
    return "signal" if can_signal else "thread"
  return isolation


def call_isolated(fn: Callable[[], Any], timeout_s: float, isolation: str = "auto") -> Any:
  """``fn()`` under the time limit of ``isolation`` (see the module docstring); raises
  ``VerifierTimeout`` past ``timeout_s`` seconds and whatever ``fn`` raises."""
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
  call = _call_with_alarm if _resolve_isolation(isolation) == "signal" else _call_in_thread
  return call(fn, timeout_s)


def _number(x: Any) -> float | None:
  """``x`` as a finite float when it is a real number (bool, int, float, NumPy scalar)."""
  if isinstance(x, (numbers.Real, np.number)) and not isinstance(x, np.complexfloating):
    v = float(x)
    return v if math.isfinite(v) else None
  return None


def reward_value(value: Any, lenient: bool = True) -> float | dict[str, float] | None:
  """A verifier's (or group function's) value for one row as a float or a ``{name: float}``
  dict; None when it is neither (a non-finite number, a component that is not a finite
  number, an empty mapping or a key that is not a string). ``lenient`` also accepts what
  ``float()`` converts (a numeric string), as verifiers always could."""
  if isinstance(value, Mapping):
    out = {}
    for k, v in value.items():
      out[k] = _number(v)
      if not isinstance(k, str) or out[k] is None:
        return None
    return out or None
  if lenient and not isinstance(value, (numbers.Real, np.number)):
    try:
      value = float(value)
    except (TypeError, ValueError):
      return None
  return _number(value)


def component_names(value: Any) -> tuple[str, ...]:
  """The component names of one row's value: its keys in order, () for a number."""
  return tuple(value) if isinstance(value, Mapping) else ()


def failure(stats: dict, text: str) -> None:
  """Keeps ``text`` in ``stats["errors"]``, the first ``NOTED_FAILURES`` distinct failures of
  a scoring call (``note_failures`` prints them)."""
  errors = stats.setdefault("errors", [])
  if text not in errors and len(errors) < NOTED_FAILURES:
    errors.append(text)


_noted: dict[str, set[str]] = {}  # who -> the failures printed so far in this process


def note_failures(who: str, errors: Sequence[str]) -> None:
  """One stderr ``note:`` line for each of the first ``NOTED_FAILURES`` distinct failures of
  the reward source ``who`` in this process: the metrics only count them
  (``reward_exceptions``, ``reward_timeouts``), and a reward function that fails on every
  row otherwise trains on zeros without a word."""
  seen = _noted.setdefault(who, set())
  for text in errors:
    if text not in seen and len(seen) < NOTED_FAILURES:
      seen.add(text)
      print(f"note: {who} failed on a row, which scores 0 (counted in reward_exceptions or "
            f"reward_timeouts): {text[:300]}", file=sys.stderr, flush=True)


def verify_rows(verify_fn: VerifyFn, completions: Sequence[str], references: Sequence[Any],
                timeout_s: float = 5.0, isolation: str = "auto"
                ) -> tuple[list[float | dict[str, float] | None], dict[str, int]]:
  """Each row's verifier value (a float or ``{name: float}``; None where the call failed),
  each call isolated and time-limited, and the counters ``{"exceptions", "timeouts"}`` (with
  ``"errors"``, the first distinct failures' texts, when a call failed: ``failure``).

  Raises:
    ValueError: mismatched lengths, non-positive timeout, unknown isolation.
  """
  if len(completions) != len(references):
    raise ValueError(f"{len(completions)} completions but {len(references)} references")
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
  _resolve_isolation(isolation)
  values: list[float | dict[str, float] | None] = []
  stats = {"exceptions": 0, "timeouts": 0}
  for c, r in zip(completions, references):
    try:
      raw = call_isolated(lambda c=c, r=r: verify_fn(c, r), timeout_s, isolation)
      value = reward_value(raw)
    except VerifierTimeout:
      stats["timeouts"] += 1
      failure(stats, f"a call took longer than data.reward_timeout_s={timeout_s:g} s")
      value = None
    except Exception as e:  # noqa: BLE001 -- any verifier failure is reward 0, counted
      stats["exceptions"] += 1
      failure(stats, f"{type(e).__name__}: {e}")
      value = None
    else:
      if value is None:  # non-numeric or non-finite
        stats["exceptions"] += 1
        failure(stats, f"it returned {raw!r:.80}, not a finite number")
    values.append(value)
  return values, stats


def stack_components(values: Sequence[float | Mapping[str, float] | None],
                     names: Sequence[str] = (), who: str = "the verifier"
                     ) -> tuple[np.ndarray, np.ndarray | None]:
  """Totals float32 [B] and components float32 [B,C] (None when ``names`` is empty) of the
  rows' ``values`` (None: a failed row, 0 everywhere); C = len(names), in that order.

  Raises:
    RLJaxError: one line naming ``who``: a row's component names differ from ``names`` (a
      number where components are expected counts as no names, and the reverse).
  """
  names = tuple(names)
  totals = np.zeros(len(values), np.float32)
  comps = np.zeros((len(values), len(names)), np.float32) if names else None
  for i, v in enumerate(values):
    if v is None:
      continue
    got = component_names(v)
    if (set(got) != set(names)) or len(got) != len(names):
      what = f"components {list(got)}" if got else "a number"
      want = f"components {list(names)}" if names else "a number (no components)"
      raise RLJaxError(f"{who} returned {what} for row {i}, but the run's rewards are {want} "
                       "(set by its value on the first training example); every row needs "
                       "the same component names")
    if names:
      comps[i] = [v[k] for k in names]
      totals[i] = float(sum(v[k] for k in names))
    else:
      totals[i] = v
  return totals, comps


def compute_rewards(verify_fn: VerifyFn, completions: Sequence[str], references: Sequence[Any],
                    timeout_s: float = 5.0, isolation: str = "auto"
                    ) -> tuple[np.ndarray, dict[str, int]]:
  """Rewards of B completions, each verifier call isolated and time-limited.

  Args:
    verify_fn: ``verify_fn(completion, reference) -> float`` (or ``{name: float}``: the
      reward is the sum of the components).
    completions: B decoded completions.
    references: B references (one per completion).
    timeout_s: per-call time limit in seconds (> 0).
    isolation: ``"auto"``, ``"signal"`` or ``"thread"`` (see module docstring).

  Returns:
    (rewards float32 [B], stats) with stats ``{"exceptions": int, "timeouts": int}``;
    failed calls give reward 0.

  Raises:
    ValueError: mismatched lengths, non-positive timeout, unknown isolation.
  """
  values, stats = verify_rows(verify_fn, completions, references, timeout_s, isolation)
  total = lambda v: 0.0 if v is None else float(sum(v.values()) if isinstance(v, dict) else v)
  return np.asarray([total(v) for v in values], np.float32), stats


def overlong_penalty(lengths: Any, max_length: int, cache_length: int) -> np.ndarray:
  """DAPO soft overlong punishment, added to the task reward.

  ``0`` for ``L ≤ L_max − L_cache``; ``(L_max − L_cache − L) / L_cache`` for
  ``L_max − L_cache < L ≤ L_max`` (linear from 0 down to −1); ``−1`` beyond ``L_max``.

  Args:
    lengths: response lengths in tokens, int [B].
    max_length: L_max, the maximum response length.
    cache_length: L_cache, the width of the penalty ramp (0 < L_cache ≤ L_max).

  Returns:
    float32 [B] penalties in [−1, 0].
  References: Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at
    Scale", Eq. 13 (overlong reward shaping).
  """
  if not 0 < cache_length <= max_length:
    raise ValueError(f"need 0 < cache_length <= max_length, got {cache_length}, {max_length}")
  lengths = np.asarray(lengths, np.float64)
  start = max_length - cache_length
  ramp = (start - lengths) / cache_length
  out = np.where(lengths <= start, 0.0, np.where(lengths <= max_length, ramp, -1.0))
  return out.astype(np.float32)
