"""Groups the rollout engine holds between calls: checkpoint export/import and the
staleness bound.

Between ``rollout_groups`` calls the engine holds complete groups beyond K (``ready``) and
aborted partial groups (``buffer``). ``export_held`` writes them as fixed-shape host arrays
for a checkpoint and ``import_held`` rebuilds them, so a resumed run continues exactly.
``_enforce_staleness`` restarts held samples holding a token too many policy versions old
(AReaL's η).

Axis letters: the legend of ``rl_jax/models/transformer.py`` (M = n samples per group,
R = max_new_tokens, P = max_prompt_len); C is the export capacity (a local letter).
"""

from __future__ import annotations

import collections
import itertools

import numpy as np

from rl_jax.rollout.kv_cache import REASON_NAMES
from rl_jax.rollout.records import REASON_CODES, GroupRequest, RolloutError, Sample

__all__ = ["HeldGroups"]


class HeldGroups:
  """Held-group state of ``RolloutEngine`` (a mixin).

  The engine sets ``n``, ``max_new_tokens``, ``max_prompt_len``, ``max_staleness``, the
  deques ``buffer`` and ``_ready`` and the uid counter ``_uids``.
  """

  def export_held(self, capacity: int) -> dict[str, np.ndarray]:
    """The held groups (complete extras, then the buffer) as fixed-shape host arrays.

    For checkpoints: ``import_held`` rebuilds the same engine state, so a resumed run
    continues exactly. Group tags must be integers (e.g. dataset indices).

    Args:
      capacity: C, rows of the arrays (>= number of held groups).
    Returns:
      dict: valid, ready bool [C]; uid, resumed, meta, prompt_len int32 [C];
      prompt int32 [C,P]; tokens, versions int32 [C,M,R]; logprobs float32 [C,M,R];
      length, reason int32 [C,M] (reason -1 = unfinished); next_uid int32 [].
    """
    held = [(r, True) for r in self._ready] + [(r, False) for r in self.buffer]
    if len(held) > capacity:
      raise RolloutError(f"{len(held)} held groups do not fit capacity {capacity}")
    C, n, R = capacity, self.n, self.max_new_tokens
    d = dict(valid=np.zeros(C, bool), ready=np.zeros(C, bool), uid=np.zeros(C, np.int32),
             resumed=np.zeros(C, np.int32), meta=np.zeros(C, np.int32),
             prompt_len=np.zeros(C, np.int32), prompt=np.zeros((C, self.max_prompt_len), np.int32),
             tokens=np.zeros((C, n, R), np.int32), versions=np.full((C, n, R), -1, np.int32),
             logprobs=np.zeros((C, n, R), np.float32), length=np.zeros((C, n), np.int32),
             reason=np.full((C, n), -1, np.int32))
    for h, (req, ready) in enumerate(held):
      d["valid"][h], d["ready"][h], d["uid"][h], d["resumed"][h] = True, ready, req.uid, req.resumed
      d["meta"][h] = -1 if req.meta is None else int(req.meta)
      d["prompt_len"][h] = len(req.prompt)
      d["prompt"][h, :len(req.prompt)] = req.prompt
      for i, smp in enumerate(req.samples):
        t = len(smp.tokens)
        d["tokens"][h, i, :t], d["versions"][h, i, :t] = smp.tokens, smp.versions
        d["logprobs"][h, i, :t], d["length"][h, i] = smp.logprobs, t
        if smp.finish_reason is not None:
          d["reason"][h, i] = REASON_CODES[smp.finish_reason]
    d["next_uid"] = np.int32(self._next_uid())
    return d

  def import_held(self, d) -> None:
    """Replace the held groups and the uid counter with ``export_held``'s arrays."""
    d = {k: np.asarray(v) for k, v in d.items()}
    self._ready.clear()
    self.buffer.clear()
    for h in np.flatnonzero(d["valid"]):
      samples = []
      for i in range(self.n):
        t = int(d["length"][h, i])
        code = int(d["reason"][h, i])
        samples.append(Sample(d["tokens"][h, i, :t].tolist(), d["logprobs"][h, i, :t].tolist(),
                              d["versions"][h, i, :t].tolist(),
                              None if code < 0 else REASON_NAMES[code]))
      meta = int(d["meta"][h])
      req = GroupRequest(int(d["uid"][h]), d["prompt"][h, :int(d["prompt_len"][h])].tolist(),
                         samples, int(d["resumed"][h]), None if meta < 0 else meta)
      (self._ready if d["ready"][h] else self.buffer).append(req)
    self._uids = itertools.count(int(d["next_uid"]))

  def _next_uid(self) -> int:
    """The uid the next new request gets (without consuming it)."""
    nxt = next(self._uids)
    self._uids = itertools.count(nxt)
    return nxt

  def _enforce_staleness(self, policy_version: int) -> int:
    """Restart held samples with a token older than ``policy_version − η``; returns how many.

    Complete groups held from the previous call that hold such a sample go back to the
    front of the buffer.
    """
    if self.max_staleness is None:
      return 0
    oldest = policy_version - self.max_staleness
    restarted = 0
    for req in list(self.buffer) + list(self._ready):
      for i, smp in enumerate(req.samples):
        if smp.versions and min(smp.versions) < oldest:
          req.samples[i] = Sample()
          restarted += 1
    stale = [r for r in self._ready if not r.done]
    self._ready = collections.deque(r for r in self._ready if r.done)
    self.buffer.extendleft(reversed(stale))
    return restarted
