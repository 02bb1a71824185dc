"""Isolated, time-limited reward computation and DAPO overlong reward shaping.

``compute_rewards`` calls a verifier ``verify_fn(completion, reference) -> float`` once per
row. A verifier that raises, returns a non-finite or non-numeric value, or runs past
``timeout_s`` gives reward 0 and is counted in the returned stats; a run never crashes on a
verifier.

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
import threading
from typing import Any, Callable, Sequence

import numpy as np

__all__ = ["VerifierTimeout", "VerifyFn", "compute_rewards", "overlong_penalty"]

VerifyFn = Callable[[str, Any], float]


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


def compute_rewards(verify_fn: VerifyFn, completions: Sequence[str], references: Sequence[Any],
                    timeout_s: float = 5.0, isolation: str = "auto"
                    ) -> tuple[np.ndarray, dict[str, int]]:
  """Rewards of B completions, each verifier call isolated and time-limited.

  Args:
    verify_fn: ``verify_fn(completion, reference) -> float``.
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
  if len(completions) != len(references):
    raise ValueError(f"{len(completions)} completions but {len(references)} references")
  if not timeout_s > 0:
    raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
  call = _call_with_alarm if _resolve_isolation(isolation) == "signal" else _call_in_thread
  rewards = np.zeros(len(completions), np.float32)
  stats = {"exceptions": 0, "timeouts": 0}
  for i, (c, r) in enumerate(zip(completions, references)):
    try:
      value = float(call(lambda c=c, r=r: verify_fn(c, r), timeout_s))
    except VerifierTimeout:
      stats["timeouts"] += 1
      continue
    except Exception:  # noqa: BLE001 -- any verifier failure is reward 0, counted
      stats["exceptions"] += 1
      continue
    if not math.isfinite(value):
      stats["exceptions"] += 1
      continue
    rewards[i] = value
  return rewards, stats


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
