"""Slot bookkeeping of the rollout engine: host arrays in and out of the device slots.

A slot holds one *unit*: ``(GroupRequest, sample ids)``, all n samples of a group
(prompt-once) or one sample (replicated). ``admission`` packs units into the sampler's
``Admission`` arrays (and lists the resumed samples whose K/V ``resume`` rebuilds);
``harvest`` and ``collect`` copy finished (or aborted) samples back into their requests and
free the slots.

Axis letters: the legend of ``rl_jax/__init__.py`` (G slots, M samples per slot,
R response cache length, T resumed tokens); Bn, Pb, Br are the admission, prompt and resume
buckets.
"""

from __future__ import annotations

import jax
import numpy as np

from rl_jax.rollout.kv_cache import REASON_NAMES, RUNNING
from rl_jax.rollout.prefill import Resume
from rl_jax.rollout.records import REASON_CODES, Sample

__all__ = ["admission", "buckets", "collect", "forks", "harvest", "resume_rows", "resume_shape",
           "resume_shapes"]


def admission(batch, Bn: int, Pb: int, *, G: int, M: int, R: int, max_new_tokens: int):
  """Host arrays of an Admission of shape (Bn, Pb) for ``batch`` (the rest padding), and
  the (row, sample, slot, tokens to prefill) of every resumed running sample.

  Args:
    batch: list of (slot, unit). G, M, R: the engine's slots, samples per slot, response
      cache length. max_new_tokens: every sample's budget.
  """
  a = dict(slots=np.full(Bn, G, np.int32), prompt=np.zeros((Bn, Pb), np.int32),
           prompt_len=np.ones(Bn, np.int32), tokens=np.zeros((Bn, M, R), np.int32),
           logprobs=np.zeros((Bn, M, R), np.float32), versions=np.full((Bn, M, R), -1, np.int32),
           length=np.zeros((Bn, M), np.int32), reason=np.zeros((Bn, M), np.int32),
           budget=np.full((Bn, M), max_new_tokens, np.int32),
           request_id=np.zeros(Bn, np.int32), sample_id=np.zeros((Bn, M), np.int32))
  resume = []  # (row, sample, slot, tokens to prefill) of resumed running samples
  for b, (g, (req, sids)) in enumerate(batch):
    a["slots"][b] = g
    a["prompt"][b, :len(req.prompt)] = req.prompt
    a["prompt_len"][b] = len(req.prompt)
    a["request_id"][b] = req.uid
    for m, i in enumerate(sids):
      s = req.samples[i]
      t = len(s.tokens)
      a["sample_id"][b, m] = i
      a["tokens"][b, m, :t] = s.tokens
      a["logprobs"][b, m, :t] = s.logprobs
      a["versions"][b, m, :t] = s.versions
      a["length"][b, m] = t
      if s.finish_reason is not None:
        a["reason"][b, m] = REASON_CODES[s.finish_reason]
      elif t > 1:
        resume.append((b, m, g, t - 1))
  return a, resume


def forks(a, resume):
  """Split ``admission``'s resumed samples into those re-prefilled and those forked.

  A resumed sample whose cached tokens (all but its last) begin another resumed sample of
  the same group is forked from it (``kv_cache.fork_samples``: the other's whole pages
  shared, the partial one copied) instead of re-prefilled: n continuations of one state, or
  re-rollouts from points of an earlier trajectory, prefill that state once. Longer samples
  are sources first.

  Returns:
    (resume rows kept, forks: list of (slot, source sample, sample, cached positions)).
  """
  kept, out = [], []
  for b, m, g, n in sorted(resume, key=lambda r: (r[0], -r[3], r[1])):
    row = a["tokens"][b]
    src = next((sm for sb, sm, _, sn in kept if sb == b and sn >= n
                and np.array_equal(row[sm, :n], row[m, :n])), None)
    if src is None:
      kept.append((b, m, g, n))
    else:
      out.append((g, src, m, n))
  return kept, out


def resume_rows(Br: int, T: int, G: int) -> Resume:
  """An all-padding Resume of shape (Br, T) for an engine of G slots."""
  return Resume(np.full(Br, G, np.int32), np.zeros(Br, np.int32),
                np.zeros((Br, T), np.int32), np.ones(Br, np.int32))


def resume_shape(rows: int, longest: int, *, G: int, M: int, R: int) -> tuple[int, int]:
  """(Br, T) bucket for re-prefilling ``rows`` samples of up to ``longest`` tokens.

  Br steps by 4x from 4 up to all G·M samples; T is R/4, R/2 or R (3 lengths).
  """
  Br = 4
  while Br < rows:
    Br *= 4
  T = max(1, R // 4)
  while T < longest:
    T *= 2
  return min(Br, G * M), min(T, R)


def resume_shapes(*, G: int, M: int, R: int) -> list[tuple[int, int]]:
  """Every (Br, T) bucket ``resume_shape`` gives for this engine's shapes, sorted: what a
  warm-up compiles."""
  rows = [1, *(4 ** i for i in range(1, (G * M).bit_length()) if 4 ** i < G * M), G * M]
  return sorted({resume_shape(r, n, G=G, M=M, R=R) for r in rows
                 for n in (R, R // 2, R // 4) if n >= 1})


def buckets(lo: int, top: int) -> list[int]:
  """Every value ``min(top, pow2(n, lo))`` takes for n = 1 .. top (powers of two from ``lo``,
  capped at ``top``): the admission, prompt and extension buckets a warm-up compiles."""
  return sorted({min(top, lo << i) for i in range(max(1, top).bit_length() + 1)})


def _merged_routing(old, new: np.ndarray) -> np.ndarray:
  """A sample's expert records [t,Y,X]: this slot's, and for tokens it holds no record of
  (a resumed sample's earlier tokens, fed before it was aborted) the earlier ones."""
  new = np.array(new)
  if old is not None and len(old):
    n = min(len(old), len(new))
    keep = new[:n, :1] < 0
    new[:n] = np.where(keep, old[:n], new[:n])
  return new


def harvest(state, slot_unit, remaining, complete):
  """Move groups whose samples all finished out of their slots.

  Returns:
    (state with the freed slots inactive, the freed slots).
  """
  reason = np.asarray(state.reason)
  done = [g for g, u in enumerate(slot_unit)
          if u is not None and (reason[g, :len(u[1])] != RUNNING).all()]
  if not done:
    return state, []
  collect(state, done, slot_unit, remaining, complete)
  active = np.zeros(len(slot_unit), bool)
  active[[g for g, u in enumerate(slot_unit) if u is not None]] = True
  state = state._replace(active=jax.device_put(active, state.active.sharding))
  return state, done


def collect(state, slots, slot_unit, remaining=None, complete=None):
  """Copy the samples of ``slots`` back into their requests and free the slots.

  A request whose last unit comes back complete is appended to ``complete`` (``remaining``
  counts the units of each request still in flight).
  """
  host = jax.device_get((state.tokens, state.logprobs, state.versions, state.length,
                         state.reason, state.routing))
  tokens, logprobs, versions, length, reason, routing = host
  for g in slots:
    req, sids = slot_unit[g]
    for m, i in enumerate(sids):
      t = int(length[g, m])
      req.samples[i] = Sample(tokens[g, m, :t].tolist(), logprobs[g, m, :t].tolist(),
                              versions[g, m, :t].tolist(),
                              REASON_NAMES[int(reason[g, m])]
                              if reason[g, m] != RUNNING else None,
                              None if routing is None else
                              _merged_routing(req.samples[i].routing, routing[g, m, :t]))
    slot_unit[g] = None
    if remaining is not None:
      remaining[id(req)] -= 1
      if remaining[id(req)] == 0 and req.done:
        complete.append(req)
