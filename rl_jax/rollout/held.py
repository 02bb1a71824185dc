"""Held groups: what a rollout engine keeps between ``rollout_groups`` calls, one home for
the single-turn engine (``engine.RolloutEngine``) and the multi-turn one (``agent.AgentEngine``).

APRIL returns exactly K complete groups per call and keeps the rest: ``ready``, the complete
groups beyond K (served first at the next call), and ``buffer``, the unfinished groups (FIFO,
served next, each resumed from its partial samples). AReaL's staleness bound η caps the groups
in flight at ``(η+1)·K`` (``records.in_flight_budget``) and restarts a held sample that holds a
token sampled more than η versions before the current policy. The uid counter numbers new
groups; uids seed every token's uniforms, so a resumed run continues the count
(``next_uid``, ``replace``).

A group is the engine's record (``records.GroupRequest`` or ``loop.Group``: anything
with ``done`` and ``resumed``), and restarting one of its samples is the engine's too (a
single-turn sample drops its tokens; a multi-turn one also resets its environment); the
serving order, the bound, the lag counters and the uid counter are here.

References: Zhou et al. 2025, "APRIL: Active Partial Rollouts in Reinforcement Learning to
Tame Long-tail Generation"; Fu et al. 2025, "AReaL" (staleness-bounded admission).
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Iterable, NamedTuple

import numpy as np

from rl_jax.rollout.records import RolloutError, in_flight_budget

__all__ = ["HeldGroups", "HoldsGroups", "Row", "lag_stats", "rows"]


class HeldGroups:
  """The held groups of one engine: ``ready`` and ``buffer`` (deques of group records) and
  the uid counter."""

  def __init__(self):
    self.ready: collections.deque = collections.deque()  # complete beyond K
    self.buffer: collections.deque = collections.deque()  # unfinished, FIFO
    self._next_uid = 0

  def new_uid(self) -> int:
    """The uid of a new group (consumed)."""
    self._next_uid += 1
    return self._next_uid - 1

  def next_uid(self) -> int:
    """The uid the next new group gets (not consumed)."""
    return self._next_uid

  def held(self) -> list[tuple[Any, bool]]:
    """Every held group with whether it is complete: ``ready`` first, then ``buffer``, the
    order a checkpoint writes them in."""
    return [(g, True) for g in self.ready] + [(g, False) for g in self.buffer]

  def replace(self, held: Iterable[tuple[Any, bool]], next_uid: int) -> None:
    """Hold exactly ``held`` ((group, complete) pairs, in ``held()``'s order) and continue
    the uid count at ``next_uid``: a checkpoint's held groups restored."""
    self.ready.clear()
    self.buffer.clear()
    for g, complete in held:
      (self.ready if complete else self.buffer).append(g)
    self._next_uid = int(next_uid)

  def export(self, capacity: int, max_prompt_len: int, prompt_of=lambda g: g.prompt
             ) -> tuple[dict[str, np.ndarray], list]:
    """The group-level arrays of a checkpoint of the held groups, in ``held()``'s order
    (``prompt_of(group)``: its whole prompt).

    Returns:
      (arrays, groups): valid, ready bool [capacity]; uid, resumed int32 [capacity]; meta
      int32 [capacity] (a group's integer tag, -1 for none); prompt_len int32 [capacity];
      prompt int32 [capacity, max_prompt_len]; next_uid int32 []. ``groups`` lists the held
      groups, row h holding ``groups[h]``; the engine adds its samples' arrays.
    """
    held = self.held()
    if len(held) > capacity:
      raise RolloutError(f"{len(held)} held groups do not fit capacity {capacity}")
    z = lambda dtype, fill=0: np.full(capacity, fill, dtype)
    d = dict(valid=z(bool), ready=z(bool), uid=z(np.int32), resumed=z(np.int32),
             meta=z(np.int32, -1), prompt_len=z(np.int32),
             prompt=np.zeros((capacity, max_prompt_len), np.int32))
    for h, (g, complete) in enumerate(held):
      d["valid"][h], d["ready"][h], d["uid"][h], d["resumed"][h] = True, complete, g.uid, g.resumed
      d["meta"][h] = -1 if g.meta is None else int(g.meta)
      prompt = prompt_of(g)
      d["prompt_len"][h], d["prompt"][h, :len(prompt)] = len(prompt), prompt
    d["next_uid"] = np.int32(self.next_uid())
    return d, [g for g, _ in held]

  def serve(self, k_groups: int, over_sampling: float, max_staleness: int | None,
            new: Callable[[], Any]) -> tuple[list, list, int]:
    """One call's groups, in APRIL's serving order.

    Args:
      k_groups: K, the complete groups the call returns. over_sampling, max_staleness: the
        engine's (``in_flight_budget``). new: the next new group, or None when the source
        has run out (called only while the in-flight budget has room).
    Returns:
      (result: up to K complete groups from ``ready``, submit: the groups to run, buffer
      first, then new ones, need: the complete groups the run must still give).
    """
    result = []
    while self.ready and len(result) < k_groups:
      result.append(self.ready.popleft())
    in_flight = in_flight_budget(k_groups, len(result), over_sampling, max_staleness)
    submit = []
    while self.buffer and len(submit) < in_flight:
      submit.append(self.buffer.popleft())
    while len(submit) < in_flight:
      g = new()
      if g is None:
        break
      submit.append(g)
    return result, submit, k_groups - len(result)

  def settle(self, result: list, complete: list, unfinished: list, need: int,
             started: Callable[[Any], bool] = lambda g: True) -> int:
    """After a run: the first ``need`` complete groups join ``result``, the other complete
    ones wait in ``ready``, the unfinished go back to the front of ``buffer`` in their order.
    Returns how many unfinished groups had ``started`` (each counts one more resume)."""
    result.extend(complete[:need])
    self.ready.extend(complete[need:])
    aborted = 0
    for g in unfinished:
      if started(g):
        g.resumed += 1
        aborted += 1
    self.buffer.extendleft(reversed(unfinished))
    return aborted

  def enforce_staleness(self, policy_version: int, max_staleness: int | None,
                        restart: Callable[[Any, int], int]) -> int:
    """Restart held samples holding a token older than ``policy_version − η``.

    ``restart(group, oldest)`` restarts the group's samples holding a version below
    ``oldest`` and returns how many it restarted; buffer first, then ready. A complete group
    that now has a restarted sample goes back to the front of the buffer. Returns the number
    of samples restarted (0 without a bound).
    """
    if max_staleness is None:
      return 0
    oldest = policy_version - max_staleness
    restarted = sum(restart(g, oldest) for g in list(self.buffer) + list(self.ready))
    stale = [g for g in self.ready if not g.done]
    self.ready = collections.deque(g for g in self.ready if g.done)
    self.buffer.extendleft(reversed(stale))
    return restarted


class HoldsGroups:
  """What an engine holding a ``HeldGroups`` (``self.held``) shows of it: ``ready`` and
  ``buffer``. Both engines derive from it."""

  held: HeldGroups

  @property
  def ready(self) -> tuple:
    """Complete groups beyond K from the previous call; returned first at the next call."""
    return tuple(self.held.ready)

  @property
  def buffer(self) -> collections.deque:
    """Unfinished groups (FIFO), resumed first at the next call."""
    return self.held.buffer


def lag_stats(versions: np.ndarray, mask: np.ndarray, policy_version: int) -> dict[str, Any]:
  """``max_token_lag`` (versions behind ``policy_version``, the largest over the tokens of
  ``mask``) and ``off_policy_token_fraction`` (the masked tokens sampled by an older policy)
  of a rollout's ``versions`` and ``mask`` (int32 and bool, the same shape)."""
  lag = np.where(mask, policy_version - versions, 0)
  stale = (versions < policy_version) & mask
  return dict(max_token_lag=int(lag.max(initial=0)),
              off_policy_token_fraction=float(stale.sum() / max(mask.sum(), 1)))


class Row(NamedTuple):
  """One held group of a checkpoint's arrays (``HeldGroups.export``)."""

  h: int  # its row
  uid: int
  resumed: int
  meta: int | None
  prompt: list[int]
  ready: bool  # complete (held beyond K) or unfinished (in the buffer)


def rows(d) -> list[Row]:
  """The valid rows of ``HeldGroups.export``'s arrays ``d``, in order."""
  out = []
  for h in np.flatnonzero(np.asarray(d["valid"])):
    meta = int(d["meta"][h])
    out.append(Row(int(h), int(d["uid"][h]), int(d["resumed"][h]), None if meta < 0 else meta,
                   np.asarray(d["prompt"][h, :int(d["prompt_len"][h])]).tolist(),
                   bool(d["ready"][h])))
  return out
