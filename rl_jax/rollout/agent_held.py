"""Held multi-turn groups of ``AgentEngine``: active partial rollouts across turns (APRIL), the
staleness bound, and checkpoint export/import by environment replay.

``rollout_groups`` returns exactly K complete groups and holds the unfinished rest: a sample
may be held mid-turn (its partial turn is kept with per-token versions), waiting on its
environment (the step keeps running; its outcome is applied at the next call) or with an
observation not yet appended. Held groups resume first at the next call, re-prefilled from
their full history with the new weights. A held sample with a model token more than η
versions old is restarted (a fresh environment, reset with the same seed).

``export_held`` writes the held groups as fixed-shape arrays plus the recorded actions;
``import_held`` rebuilds each environment by ``reset`` + replay of its actions (episodes are
deterministic given example, seed and actions: ``rl_jax.envs.base``), so a resumed run
continues exactly. A step that timed out originally is replayed as a plain step (its late
effects on the environment cannot be known).

Axis letters: the legend of ``rl_jax/__init__.py`` (M samples, R trajectory
length, P prompt length); U turns; C the export capacity (local letters).
"""

from __future__ import annotations

import collections
import itertools
import math
from typing import Any, Callable, Iterable

import numpy as np

from rl_jax.envs.base import Message, StepResult
from rl_jax.rollout.agent_loop import (DONE, READY, RUN, WAIT, Loop, apply_outcome,
                                      poll_outcomes)
from rl_jax.rollout.agent_records import AgentRollout, EpisodeSpec, Trajectory, env_seed
from rl_jax.rollout.env_pool import StepOutcome, error_message, observation_ids
from rl_jax.rollout.records import RolloutError, check_int

__all__ = ["HeldEpisodes"]

_STATUS = (RUN, WAIT, READY, DONE)
_COUNTERS = ("tool_calls", "tool_errors", "timeouts", "env_errors", "truncated_obs",
             "truncated_turn")


class HeldEpisodes:
  """APRIL across turns for ``AgentEngine`` (a mixin; the engine sets ``buffer``,
  ``_ready``, ``live``, ``over_sampling``, ``max_staleness`` and the uid counter)."""

  def rollout_groups(self, params, episodes: Iterable[EpisodeSpec], k_groups: int, *,
                     policy_version: int = 0) -> AgentRollout:
    """Return exactly ``k_groups`` complete groups, holding the unfinished rest.

    Serving order: complete extras of the previous call, held groups (FIFO), then new
    episodes from ``episodes`` until ``ceil(over_sampling·K)`` groups are in flight (at most
    ``(η+1)·K`` under the staleness bound). Pass an iterator to keep its position.

    Returns:
      AgentRollout of K·M rows; stats add ``held_groups``, ``resumed_groups``,
      ``restarted_samples``, ``max_token_lag`` and ``off_policy_token_fraction``.
    """
    check_int("k_groups", k_groups, 1)
    params = self.prepare_params(params)
    it = iter(episodes)
    restarted = self._enforce_staleness(policy_version)
    result = []
    while self._ready and len(result) < k_groups:
      result.append(self._ready.popleft())
    need = k_groups - len(result)
    in_flight = math.ceil(self.over_sampling * k_groups)
    if self.max_staleness is not None:
      in_flight = min(in_flight, (self.max_staleness + 1) * k_groups)
    in_flight = in_flight - len(result) if need > 0 else 0
    submit = []
    while self.buffer and len(submit) < in_flight:
      submit.append(self.buffer.popleft())
    while len(submit) < in_flight:
      spec = next(it, None)
      if spec is None:
        break
      grp = self.new_group(spec)
      self.live[grp.uid] = grp
      submit.append(grp)
    loop = Loop(self, params, policy_version)
    if submit:
      complete, unfinished = loop.run(submit, min_complete=need)
      result += complete[:need]
      self._ready.extend(complete[need:])
      for grp in unfinished:
        grp.resumed += 1
      self.buffer.extendleft(reversed(unfinished))
    for grp in result:
      self.live.pop(grp.uid, None)
    out = loop.result(result)
    lag = np.where(out.model_mask, policy_version - out.versions, 0)
    stale = (out.versions < policy_version) & out.model_mask
    out.stats.update(held_groups=len(self.buffer), restarted_samples=restarted,
                     resumed_groups=sum(1 for g in result if g.resumed),
                     max_token_lag=int(lag.max(initial=0)),
                     off_policy_token_fraction=float(stale.sum() / max(out.model_mask.sum(), 1)))
    return out

  def _restart(self, grp, m: int) -> None:
    """Start sample m of ``grp`` over: a fresh environment reset with the same seed."""
    env = grp.spec.make_env()
    messages = list(env.reset(grp.spec.example, env_seed(self.seed, grp.uid, m)))
    grp.trajs[m] = Trajectory(env, messages)
    grp.status[m], grp.chunk[m], grp.cut[m], grp.evicted[m] = RUN, None, False, False
    grp.epoch[m] += 1  # a step still running for the old episode is discarded

  def _enforce_staleness(self, policy_version: int) -> int:
    """Restart held samples holding a model token older than ``policy_version − η``."""
    if self.max_staleness is None:
      return 0
    oldest, restarted = policy_version - self.max_staleness, 0
    for grp in list(self.buffer) + list(self._ready):
      for m, t in enumerate(grp.trajs):
        old = [v for v, model in zip(t.versions, t.model) if model and v < oldest]
        if old:
          self._restart(grp, m)
          restarted += 1
    stale = [g for g in self._ready if not g.done]
    self._ready = collections.deque(g for g in self._ready if g.done)
    self.buffer.extendleft(reversed(stale))
    return restarted

  # ---------------------------------------------------------------- checkpoints
  def export_held(self, capacity: int) -> dict[str, Any]:
    """The held groups (complete extras, then the buffer) as arrays for a checkpoint.

    Finished environment steps are applied first; steps still running are not waited for:
    their samples are exported as waiting and ``import_held`` re-runs the step in replay.

    Args:
      capacity: C rows (>= number of held groups).
    Returns:
      dict of arrays: valid, ready bool [C]; uid, resumed, meta, prompt_len int32 [C];
      prompt int32 [C,P]; tokens, versions, turn int32 [C,M,R]; logprobs float32 [C,M,R];
      model bool [C,M,R]; length, status, budget, turn_start, cut, n_rewards, epoch and
      the counters int32 [C,M] (``status`` indexes run/wait/ready/done);
      turn_rewards float32 [C,M,U];
      turn_ends int32 [C,M,U]; env_time float32 [C,M]; finish str [C,M]; next_uid int32 [];
      and ``actions``: per row, per sample, the list of decoded actions.
    """
    poll_outcomes(self)
    held = [(g, True) for g in self._ready] + [(g, False) for g in self.buffer]
    if len(held) > capacity:
      raise RolloutError(f"{len(held)} held groups do not fit capacity {capacity}")
    C, M, R, U = capacity, self.M, self.R, self.max_turns
    z = lambda shape, dt, fill=0: np.full(shape, fill, dt)
    d = dict(valid=z(C, bool), ready=z(C, bool), uid=z(C, np.int32), resumed=z(C, np.int32),
             meta=z(C, np.int32, -1), prompt_len=z(C, np.int32),
             prompt=z((C, self.max_prompt_len), np.int32), tokens=z((C, M, R), np.int32),
             versions=z((C, M, R), np.int32, -1), turn=z((C, M, R), np.int32, -1),
             logprobs=z((C, M, R), np.float32), model=z((C, M, R), bool),
             turn_rewards=z((C, M, U), np.float32), turn_ends=z((C, M, U), np.int32, -1),
             env_time=z((C, M), np.float32), finish=z((C, M), "<U16", ""),
             **{k: z((C, M), np.int32) for k in ("length", "status", "budget", "turn_start",
                                                 "cut", "n_rewards", "epoch", *_COUNTERS)})
    actions = [[[] for _ in range(M)] for _ in range(C)]
    for h, (grp, ready) in enumerate(held):
      d["valid"][h], d["ready"][h], d["uid"][h], d["resumed"][h] = True, ready, grp.uid, grp.resumed
      d["meta"][h] = -1 if grp.meta is None else int(grp.meta)
      d["prompt_len"][h], d["prompt"][h, :len(grp.prompt)] = len(grp.prompt), grp.prompt
      for m, t in enumerate(grp.trajs):
        n, u = len(t.tokens), len(t.turn_rewards)
        for k in ("tokens", "versions", "turn", "logprobs", "model"):
          d[k][h, m, :n] = getattr(t, k)
        d["turn_rewards"][h, m, :u] = t.turn_rewards
        d["turn_ends"][h, m, :len(t.turn_ends)] = t.turn_ends
        d["length"][h, m], d["status"][h, m] = n, _STATUS.index(grp.status[m])
        d["budget"][h, m], d["turn_start"][h, m] = grp.budget[m], grp.turn_start[m]
        d["cut"][h, m], d["n_rewards"][h, m] = grp.cut[m], len(t.turn_rewards)
        d["epoch"][h, m], d["env_time"][h, m] = grp.epoch[m], t.env_time
        d["finish"][h, m] = t.finish or ""
        for k in _COUNTERS:
          d[k][h, m] = getattr(t, k)
        actions[h][m] = list(t.actions)
    d["next_uid"] = np.int32(self._next_uid())
    d["actions"] = actions
    return d

  def import_held(self, d, spec_of: Callable[[Any], EpisodeSpec]) -> None:
    """Replace the held groups with ``export_held``'s, rebuilding every environment.

    ``spec_of(meta)`` returns the EpisodeSpec of a group's tag (e.g. a dataset index).
    Each sample's environment is reset with its seed and replays its recorded actions; a
    sample exported while its step was running gets that step's outcome from the replay.
    """
    self._ready.clear()
    self.buffer.clear()
    for h in np.flatnonzero(np.asarray(d["valid"])):
      meta = int(d["meta"][h])
      spec = spec_of(None if meta < 0 else meta)
      grp = self.new_group(spec, uid=int(d["uid"][h]))
      grp.resumed = int(d["resumed"][h])
      if grp.prompt != np.asarray(d["prompt"][h, :int(d["prompt_len"][h])]).tolist():
        raise RolloutError(f"held group {grp.uid}: the rebuilt first prompt differs")
      for m in range(self.M):
        self._replay(grp, m, d, h, d["actions"][h][m])
      self.live[grp.uid] = grp
      (self._ready if d["ready"][h] else self.buffer).append(grp)
    self._uids = itertools.count(int(d["next_uid"]))

  def _next_uid(self) -> int:
    """The uid the next new group gets (without consuming it)."""
    nxt = next(self._uids)
    self._uids = itertools.count(nxt)
    return nxt

  def _replay(self, grp, m: int, d, h: int, actions) -> None:
    """Restore sample m's record from row h and replay its actions on its environment."""
    t, n = grp.trajs[m], int(d["length"][h, m])
    t.append(d["tokens"][h, m, :n], d["logprobs"][h, m, :n], d["versions"][h, m, :n], False, 0)
    t.model = np.asarray(d["model"][h, m, :n]).tolist()
    t.turn = np.asarray(d["turn"][h, m, :n]).tolist()
    u = int(np.sum(np.asarray(d["turn_ends"][h, m]) >= 0))
    t.turn_ends = np.asarray(d["turn_ends"][h, m, :u]).tolist()
    t.env_time = float(d["env_time"][h, m])
    t.finish = str(d["finish"][h, m]) or None
    for k in _COUNTERS:
      setattr(t, k, type(getattr(t, k))(d[k][h, m]))
    grp.status[m] = _STATUS[int(d["status"][h, m])]
    grp.budget[m], grp.turn_start[m] = int(d["budget"][h, m]), int(d["turn_start"][h, m])
    grp.cut[m], grp.epoch[m] = bool(d["cut"][h, m]), int(d["epoch"][h, m])
    applied = int(d["n_rewards"][h, m])
    rewards = np.asarray(d["turn_rewards"][h, m, :applied]).tolist()
    for i, action in enumerate(actions):
      t.actions.append(action)
      t.messages.append(Message("assistant", action))
      try:
        res = t.env.step(action)
      except Exception as e:  # as in the pool: an error observation
        res = StepResult((error_message(f"{type(e).__name__}: {e}"),))
      ids, msgs, cut = observation_ids(self.renderer, tuple(t.messages), res.messages
                                       if not res.done else (), self.max_obs)
      if i < applied:
        t.messages.extend(msgs)
        if i == applied - 1 and grp.status[m] == READY:
          grp.chunk[m] = (list(self.renderer.end_of_turn_ids[:1]) if grp.cut[m] else []) + ids
      else:  # the step that was running at export: apply its replayed outcome now
        t.turn_rewards = rewards
        apply_outcome(self, grp, m, StepOutcome(res, ids, msgs, cut, 0.0))
        return
    t.turn_rewards = rewards
