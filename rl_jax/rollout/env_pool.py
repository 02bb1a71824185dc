"""Environment steps off the decode loop: a thread pool with per-step time-outs, and the
rendering of observations into token ids (with the per-turn observation limit).

A step runs ``env.step(action)`` then renders the environment's messages with the
renderer's ``delta_ids`` in a worker thread, so the host loop keeps the device decoding.
An exception raised by the environment, a result ``envs.base.step_problem`` refuses (not a
``StepResult``, a reward that is not a finite number), or a step running longer than the
time-out (counted
from when the worker starts it, not from submission; also one that finished late before the
loop looked), becomes an error observation
(``error_message``) that is flagged in the outcome; the loop never crashes or stalls on it.
A timed-out worker cannot be interrupted: its late result is discarded (size the pool for
the steps that may hang).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import sys
import time
from typing import Any, Callable, Sequence

from rl_jax.envs.base import Message, StepResult, step_problem

__all__ = ["EnvPool", "StepOutcome", "error_message", "observation_ids"]


@dataclasses.dataclass
class StepOutcome:
  """One finished environment step.

  result: the environment's StepResult (a stand-in with the error observation after a
  time-out or an exception). ids: observation ids to append (``delta_ids``, truncated).
  messages: the messages those ids render (contents cut when truncated).
  truncated: the observation was cut to the limit. elapsed: seconds in the step.
  timed_out: the step ran past the time-out. error: the exception's text, else None.
  """

  result: StepResult
  ids: list[int]
  messages: tuple[Message, ...]
  truncated: bool
  elapsed: float
  timed_out: bool = False
  error: str | None = None


def error_message(text: str) -> Message:
  """The observation standing in for a failed or timed-out step."""
  return Message("tool", f"error: {text}")


def _cut(messages: Sequence[Message], chars: int) -> tuple[Message, ...]:
  return tuple(dataclasses.replace(m, content=m.content[:chars]) for m in messages)


def observation_ids(renderer, history: Sequence[Message], messages: Sequence[Message],
                    limit: int) -> tuple[list[int], tuple[Message, ...], bool]:
  """``renderer.delta_ids(history, messages)`` within ``limit`` ids.

  A longer observation keeps the chat format: each message's content is cut to the largest
  character count whose rendering fits (binary search); only if even empty contents do not
  fit are the ids themselves cut.

  Returns:
    (ids, the messages they render, truncated).
  """
  messages = tuple(messages)
  ids = list(renderer.delta_ids(history, messages))
  if len(ids) <= limit:
    return ids, messages, False
  lo, hi = -1, max((len(m.content) for m in messages), default=0)  # fits(lo), not fits(hi)
  best = None
  while hi - lo > 1:
    mid = (lo + hi) // 2
    cand = list(renderer.delta_ids(history, _cut(messages, mid)))
    if len(cand) <= limit:
      lo, best = mid, cand
    else:
      hi = mid
  if best is None:
    return ids[:limit], _cut(messages, 0), True
  return best, _cut(messages, lo), True


class EnvPool:
  """Environment steps in worker threads, polled without blocking the decode loop.

  Args:
    workers: threads (steps run concurrently up to this many).
    timeout: seconds a step may run (None = no limit).
  """

  def __init__(self, workers: int, timeout: float | None):
    self._pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="env")
    self.timeout = timeout
    self._pending: dict[Any, tuple[cf.Future, dict, Callable]] = {}
    self.reported: set[str] = set()  # the failures ``_note`` has printed

  def _note(self, error: str) -> None:
    """One stderr line for each of the first few distinct failures of the environment, which
    the metrics only count (``reward_exceptions``)."""
    if error not in self.reported and len(self.reported) < 3:
      self.reported.add(error)
      print(f"note: an environment step failed; the model sees the error as its observation "
            f"and reward_exceptions counts it: {error[:300]}", file=sys.stderr, flush=True)

  def __len__(self) -> int:
    return len(self._pending)

  def submit(self, key, env, action: str, render: Callable[[Sequence[Message]], Any]):
    """Run ``env.step(action)`` then ``render(messages) -> (ids, messages, truncated)``."""
    box: dict[str, float] = {}

    def work():
      box["start"] = time.monotonic()
      try:
        result, error = env.step(action), None
      except Exception as e:  # the environment failed: an error observation, not a crash
        result, error = None, f"{type(e).__name__}: {e}"
      else:
        problem = step_problem(result)  # a malformed result fails the same way
        if problem:
          result, error = None, f"TypeError: {problem}"
      box["elapsed"] = time.monotonic() - box["start"]
      if error is not None:
        return None, error, render((error_message(error),))
      return result, None, (([], (), False) if result.done else render(result.messages))

    self._pending[key] = (self._pool.submit(work), box, render)

  def keys(self) -> list:
    """The keys of the steps not yet returned, in submission order."""
    return list(self._pending)

  def _finished(self, key, now: float) -> StepOutcome | None:
    """The outcome of step ``key`` if it finished or ran past the time-out, else None."""
    fut, box, render = self._pending[key]
    late = self.timeout is not None and "start" in box and (
        box.get("elapsed", now - box["start"]) > self.timeout)
    if fut.done() and not late:
      result, error, (ids, msgs, cut) = fut.result()  # a renderer error propagates
      if result is None:
        result = StepResult(msgs)
        self._note(error)
      return StepOutcome(result, ids, msgs, cut, box["elapsed"], error=error)
    if late:  # also a step that finished past the time-out before anyone looked
      text = self.timeout_text()
      ids, msgs, cut = render((error_message(text),))
      return StepOutcome(StepResult(msgs), ids, msgs, cut,
                         box.get("elapsed", now - box["start"]), timed_out=True, error=text)
    return None

  def poll(self) -> list[tuple[Any, StepOutcome]]:
    """Finished (or timed-out) steps, in submission order; never blocks."""
    out, now = [], time.monotonic()
    for key in list(self._pending):
      outcome = self._finished(key, now)
      if outcome is not None:
        out.append((key, outcome))
        del self._pending[key]
    return out

  def take(self, keys) -> list[tuple[Any, StepOutcome]]:
    """The outcomes of the steps ``keys``, in that order, waiting for each one until it
    finishes or runs past the time-out."""
    out = []
    for key in keys:
      while (outcome := self._finished(key, time.monotonic())) is None:
        fut = self._pending[key][0]
        cf.wait([fut], timeout=None if self.timeout is None else 0.05)
      out.append((key, outcome))
      del self._pending[key]
    return out

  def timeout_text(self) -> str:
    """The error text a timed-out step's observation carries."""
    if self.timeout is None:
      return "environment step timed out"
    return f"environment step timed out after {self.timeout:g} s"

  def replay_late(self, step: Callable[[str], Any], action: str) -> str:
    """Re-run a step recorded as timed out (its effects on the environment happened, late):
    in a worker, waited for at most the time-out. Returns the recorded error text."""
    fut = self._pool.submit(step, action)
    cf.wait([fut], timeout=self.timeout)
    return self.timeout_text()

  def discard(self, key) -> None:
    """Forget step ``key`` (its result is never returned)."""
    self._pending.pop(key, None)

  def wait(self, seconds: float) -> None:
    """Block until a step finishes or ``seconds`` pass."""
    futs = [f for f, _, _ in self._pending.values()]
    if futs:
      cf.wait(futs, timeout=max(seconds, 0.0), return_when=cf.FIRST_COMPLETED)

  def wait_all(self) -> None:
    """Block until every pending step finishes or passes its time-out (then ``poll``
    returns them all)."""
    while True:
      now = time.monotonic()
      running = [f for f, box, _ in self._pending.values() if not f.done() and not (
          self.timeout is not None and "start" in box and now - box["start"] > self.timeout)]
      if not running:
        return
      cf.wait(running, timeout=None if self.timeout is None else 0.05)

  def drop(self) -> None:
    """Forget every pending step (its result is never returned; the thread finishes in the
    background)."""
    self._pending.clear()

  def close(self) -> None:
    """Stop accepting steps; running ones finish in the background."""
    self._pool.shutdown(wait=False, cancel_futures=True)

