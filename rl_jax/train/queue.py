"""The runner's queue as train-state arrays (``TrainState.rollout_queue``).

Scored batches sampled ahead of the learner (``records.Scored``) are checkpointed with the
rest of the state, so a resumed asynchronous run trains on exactly the batches it would have.
The queue is a dict of fixed-shape host arrays with Q slots (``Schedule.queue``) and a
``count`` of the slots in use, oldest first. The stored fields are ``Scored``'s own (its
array fields, ``rollout_s``, ``version``, and ``stats`` as one column per ``records.STATS``);
multi-turn runs (``env.name``) add the per-turn inputs (``Scored.turns``) and their step
metrics (``agent_stats``, one column per ``AGENT_STATS``), mixture-of-experts models the
sampler's expert records (``routing``), runs with named reward components their values
(``components``); a run without them keeps exactly the arrays it had.

Shapes (the package legend, ``rl_jax/__init__.py``): Q slots, G groups, M samples per
prompt, P prompt bucket, R new tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from rl_jax import config as config_lib
from rl_jax.envs.tools import ERROR_KINDS
from rl_jax.train.agent_stage import METRICS
from rl_jax.train.records import STATS, array_fields

__all__ = ["AGENT_STATS", "empty_queue", "setup_queue", "to_arrays", "from_arrays"]

# the multi-turn step metrics a queued batch keeps (tool errors of the built-in tools' kinds)
AGENT_STATS = METRICS + tuple(f"tool_errors_{k}" for k in ERROR_KINDS)


def empty_queue(Q: int, geo: config_lib.Geometry, prompt_len: int, *, model_cfg: Any = None,
                reward_names: tuple = ()) -> dict[str, np.ndarray]:
  """The queue of Q slots (``Schedule.queue``) with nothing in it (``{}`` when Q is 0: lag 0)
  for batches of the geometry ``geo`` and prompts of ``prompt_len`` tokens (P):

  count int32 []; indices int32 [Q,G]; prompts int32 [Q,G,P]; prompt_lens int32 [Q,G];
  tokens / versions int32 [Q,G·M,R]; mask bool [Q,G·M,R]; logprobs float32 [Q,G·M,R];
  rewards float32 [Q,G,M]; faults int32 [Q,2]; rollout_s float32 [Q]; version int32 [Q];
  stats float32 [Q, len(STATS)]; multi-turn (``geo.multi_turn``) also turn_rewards float32
  [Q,G·M,U], turn_ids int32 [Q,G·M,R], turn_states int32 [Q,G·M,U] and agent_stats float32
  [Q, len(AGENT_STATS)]; with a mixture-of-experts ``model_cfg`` also routing int32
  [Q,G·M,R,Y,X] (-1: none recorded); with C ``reward_names`` (``Setup.reward_names``) also
  components float32 [Q,G,M,C].
  """
  if not Q:
    return {}
  G, M, R, P = geo.groups, geo.samples, geo.new_tokens, prompt_len
  rows = (Q, G * M, R)
  turns = {} if not geo.multi_turn else {
      "turn_rewards": np.zeros((Q, G * M, geo.turns), np.float32),
      "turn_ids": np.zeros(rows, np.int32),
      "turn_states": np.zeros((Q, G * M, geo.turns), np.int32),
      "agent_stats": np.full((Q, len(AGENT_STATS)), np.nan, np.float32)}
  moe = {} if model_cfg is None or not model_cfg.is_moe else {"routing": np.full(
      (*rows, len(model_cfg.moe_layers), model_cfg.num_experts_per_tok), -1, np.int32)}
  C = len(reward_names)
  comps = {"components": np.zeros((Q, G, M, C), np.float32)} if C else {}
  return {**turns, **moe, **comps,
      "count": np.zeros((), np.int32),
      "indices": np.zeros((Q, G), np.int32),
      "prompts": np.zeros((Q, G, P), np.int32),
      "prompt_lens": np.zeros((Q, G), np.int32),
      "tokens": np.zeros(rows, np.int32),
      "mask": np.zeros(rows, bool),
      "logprobs": np.zeros(rows, np.float32),
      "versions": np.zeros(rows, np.int32),
      "rewards": np.zeros((Q, G, M), np.float32),
      "faults": np.zeros((Q, 2), np.int32),
      "rollout_s": np.zeros((Q,), np.float32),
      "version": np.zeros((Q,), np.int32),
      "stats": np.full((Q, len(STATS)), np.nan, np.float32),
  }


def setup_queue(s) -> dict[str, np.ndarray]:
  """The empty queue of the setup ``s`` (its schedule, geometry, prompt bucket, model and
  reward components)."""
  return empty_queue(s.schedule.queue, s.geometry, s.prompt_len, model_cfg=s.model_cfg,
                     reward_names=s.reward_names)


def to_arrays(empty: dict[str, np.ndarray], items) -> dict[str, np.ndarray]:
  """``items`` (scored batches, oldest first) in a copy of the queue ``empty``
  (``empty_queue``, ``setup_queue``)."""
  out = {k: np.array(v) for k, v in empty.items()}
  if not out:
    return out
  if len(items) > len(out["version"]):
    raise ValueError(f"{len(items)} batches do not fit a queue of {len(out['version'])}")
  out["count"] = np.asarray(len(items), np.int32)
  for i, x in enumerate(items):
    for name in array_fields():
      out[name][i] = getattr(x, name)
    out["rollout_s"][i], out["version"][i] = x.rollout_s, x.version
    out["stats"][i] = [x.stats.get(k, np.nan) for k in STATS]
    if "agent_stats" in out:
      for name, v in x.turns.items():
        out[name][i] = v
      out["agent_stats"][i] = [x.stats.get(k, np.nan) for k in AGENT_STATS]
    if "routing" in out and getattr(x, "routing", None) is not None:
      out["routing"][i] = x.routing
    if "components" in out:
      out["components"][i] = x.components
  return out


def from_arrays(arrays: dict) -> list[dict[str, Any]]:
  """The queued batches as keyword dicts of ``records.Scored`` (arrays may live on
  devices); inverse of ``to_arrays``."""
  if not arrays:
    return []
  a = jax.device_get(arrays)
  out = []
  for i in range(int(a["count"])):
    x = {name: np.asarray(a[name][i]) for name in array_fields()}
    x.update(rollout_s=float(a["rollout_s"][i]), version=int(a["version"][i]),
             stats={k: float(v) for k, v in zip(STATS, a["stats"][i]) if not np.isnan(v)})
    if "agent_stats" in a:
      x["turns"] = {k: np.asarray(a[k][i]) for k in ("turn_rewards", "turn_ids", "turn_states")}
      x["stats"].update({k: float(v) for k, v in zip(AGENT_STATS, a["agent_stats"][i])
                         if not np.isnan(v)})
    if "routing" in a:
      x["routing"] = np.asarray(a["routing"][i])
    if "components" in a:
      x["components"] = np.asarray(a["components"][i])
    out.append(x)
  return out
