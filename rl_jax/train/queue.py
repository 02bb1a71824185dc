"""The asynchronous trainer's queue as train-state arrays (``TrainState.rollout_queue``).

Scored batches sampled ahead of the learner (``rollouts.Scored``) are checkpointed with the
rest of the state, so a resumed asynchronous run trains on exactly the batches it would have.
The queue is a dict of fixed-shape host arrays with Q slots (``capacity``) and a ``count``
of the slots in use, oldest first.

Shapes (package legend): Q slots, G groups, M samples per prompt, R new tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rl_jax.train import selection_stage

__all__ = ["ENGINE_STATS", "FIELDS", "capacity", "empty_queue", "to_arrays", "from_arrays"]

# Engine and selection counters carried through the queue (NaN where not reported).
ENGINE_STATS = ("off_policy_token_fraction", "max_token_lag", "aborted_groups",
                "restarted_samples", "buffer_size") + selection_stage.METRICS
# The array fields of a scored batch, stored slot by slot.
FIELDS = ("indices", "tokens", "mask", "logprobs", "versions", "rewards", "faults")


def capacity(config) -> int:
  """Q, the batches the queue holds: k for a fixed lag k (``train.async_lag``); η for a
  free-running producer (η = ``rollout.max_staleness``: at most η batches wait while the
  learner trains on another)."""
  lag = config.train.async_lag
  return lag if lag >= 0 else max(config.rollout.max_staleness, 1)


def empty_queue(config) -> dict[str, np.ndarray]:
  """The queue with nothing in it (``{}`` in sync mode and for a lag of 0):

  count int32 []; indices int32 [Q,G]; tokens / versions int32 [Q,G·M,R]; mask bool
  [Q,G·M,R]; logprobs float32 [Q,G·M,R]; rewards float32 [Q,G,M]; faults int32 [Q,2];
  rollout_s float32 [Q]; version int32 [Q]; stats float32 [Q, len(ENGINE_STATS)].
  """
  if config.train.mode != "async" or capacity(config) == 0:
    return {}
  Q, G = capacity(config), config.train.batch_groups
  M, R = config.rollout.n, config.rollout.max_new_tokens
  rows = (Q, G * M, R)
  return {
      "count": np.zeros((), np.int32),
      "indices": np.zeros((Q, G), np.int32),
      "tokens": np.zeros(rows, np.int32),
      "mask": np.zeros(rows, bool),
      "logprobs": np.zeros(rows, np.float32),
      "versions": np.zeros(rows, np.int32),
      "rewards": np.zeros((Q, G, M), np.float32),
      "faults": np.zeros((Q, 2), np.int32),
      "rollout_s": np.zeros((Q,), np.float32),
      "version": np.zeros((Q,), np.int32),
      "stats": np.full((Q, len(ENGINE_STATS)), np.nan, np.float32),
  }


def to_arrays(config, items) -> dict[str, np.ndarray]:
  """``items`` (scored batches, oldest first) in ``empty_queue``'s arrays."""
  out = empty_queue(config)
  if not out:
    return out
  if len(items) > len(out["version"]):
    raise ValueError(f"{len(items)} batches do not fit a queue of {len(out['version'])}")
  out["count"] = np.asarray(len(items), np.int32)
  for i, x in enumerate(items):
    for name in FIELDS:
      out[name][i] = getattr(x, name)
    out["rollout_s"][i], out["version"][i] = x.rollout_s, x.version
    out["stats"][i] = [x.stats.get(k, np.nan) for k in ENGINE_STATS]
  return out


def from_arrays(arrays: dict) -> list[dict[str, Any]]:
  """The queued batches as keyword dicts of ``rollouts.Scored`` (arrays may live on
  devices); inverse of ``to_arrays``."""
  if not arrays:
    return []
  a = jax.device_get(arrays)
  out = []
  for i in range(int(a["count"])):
    x = {name: np.asarray(a[name][i]) for name in FIELDS}
    x.update(rollout_s=float(a["rollout_s"][i]), version=int(a["version"][i]),
             stats={k: float(v) for k, v in zip(ENGINE_STATS, a["stats"][i])
                    if not np.isnan(v)})
    out.append(x)
  return out
