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
A timed-out step cannot be interrupted: its thread runs on in the background, no longer
counted against ``workers`` (the next waiting step starts in its place), and its late result
is discarded. The threads are daemons, so a step that never returns does not keep the
process from exiting.
"""

from __future__ import annotations

import collections
import concurrent.futures as cf
import dataclasses
import sys
import threading
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
    self.workers, self.timeout = int(workers), timeout
    self._pending: dict[Any, tuple[cf.Future, dict, Callable]] = {}
    self._waiting: collections.deque = collections.deque()  # (future, box, fn) not started
    self._running: list[tuple[cf.Future, dict]] = []  # started, neither done nor late
    self._closed = False
    self._lock = threading.Lock()  # _waiting and _running: a finishing step starts the next
    self.reported: set[str] = set()  # the failures ``_note`` has printed

  def _late(self, box: dict, now: float) -> bool:
    return self.timeout is not None and "start" in box and (
        box.get("elapsed", now - box["start"]) > self.timeout)

  def _spawn(self, fut: cf.Future, fn: Callable) -> None:
    """``fn()`` into ``fut`` on a daemon thread, which then starts the next waiting step."""
    def run():
      if fut.set_running_or_notify_cancel():
        try:
          fut.set_result(fn())
        except BaseException as e:  # pylint: disable=broad-except
          fut.set_exception(e)
      self._launch()
    threading.Thread(target=run, name="env", daemon=True).start()

  def _launch(self) -> None:
    """Starts waiting steps while fewer than ``workers`` run (a timed-out step no longer
    counts: its thread cannot be stopped, so it is left behind)."""
    with self._lock:
      now = time.monotonic()
      self._running = [(f, b) for f, b in self._running
                       if not f.done() and not self._late(b, now)]
      while self._waiting and len(self._running) < self.workers and not self._closed:
        fut, box, fn = self._waiting.popleft()
        if not fut.cancelled():
          self._spawn(fut, fn)
          self._running.append((fut, box))

  def _submit(self, fn: Callable, box: dict) -> cf.Future:
    fut = cf.Future()
    with self._lock:
      self._waiting.append((fut, box, fn))
    self._launch()
    return fut

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

    self._pending[key] = (self._submit(work, box), box, render)

  def keys(self) -> list:
    """The keys of the steps not yet returned, in submission order."""
    return list(self._pending)

  def _finished(self, key, now: float) -> StepOutcome | None:
    """The outcome of step ``key`` if it finished or ran past the time-out, else None."""
    self._launch()
    fut, box, render = self._pending[key]
    late = self._late(box, now)
    if fut.done() and not late:
      result, error, (ids, msgs, cut) = fut.result()  # a renderer error propagates
      if result is None:
        result = StepResult(msgs)
        self._note(error)
      return StepOutcome(result, ids, msgs, cut, box["elapsed"], error=error)
    if late:  # also a step that finished past the time-out before anyone looked
      text = self.timeout_text()
      if "timeout" not in self.reported:
        self.reported.add("timeout")
        print(f"note: an environment step ran past env.step_timeout_s={self.timeout:g} s; the "
              "model sees a time-out error as its observation and reward_timeouts counts it "
              "(a step that never returns runs on in a background thread)", file=sys.stderr,
              flush=True)
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
    fut = cf.Future()
    self._spawn(fut, lambda: step(action))
    cf.wait([fut], timeout=self.timeout)
    return self.timeout_text()

  def discard(self, key) -> None:
    """Forget step ``key`` (its result is never returned; not started, it never runs)."""
    entry = self._pending.pop(key, None)
    if entry is not None:
      entry[0].cancel()

  def wait(self, seconds: float) -> None:
    """Block until a step finishes or ``seconds`` pass."""
    self._launch()
    futs = [f for f, _, _ in self._pending.values()]
    if futs:
      cf.wait(futs, timeout=max(seconds, 0.0), return_when=cf.FIRST_COMPLETED)

  def wait_all(self) -> None:
    """Block until every pending step finishes or passes its time-out (then ``poll``
    returns them all)."""
    while True:
      self._launch()
      now = time.monotonic()
      running = [f for f, box, _ in self._pending.values()
                 if not f.done() and not self._late(box, now)]
      if not running:
        return
      cf.wait(running, timeout=None if self.timeout is None else 0.05)

  def drop(self) -> None:
    """Forget every pending step (its result is never returned; the thread finishes in the
    background; one not started never runs)."""
    for fut, _, _ in self._pending.values():
      fut.cancel()
    self._pending.clear()

  def close(self) -> None:
    """Stop starting steps (waiting ones never run); running ones finish in the background."""
    with self._lock:
      self._closed = True
      for fut, _, _ in self._waiting:
        fut.cancel()
      self._waiting.clear()

