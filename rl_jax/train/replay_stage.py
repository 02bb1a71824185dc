"""Experience replay of a step (``train.replay``): scored groups kept from earlier steps
take the place of part of the step's fresh groups.

Strategy (docs/ALGORITHMS.md, "Experience replay"): the buffer is a ring of the last ``capacity``
(``train.replay.capacity``) scored groups *with reward variance*, the only ones that carry
a non-zero advantage under group-normalised estimators (the informative groups RLEP replays,
Zhang et al. 2025, "RLEP: Reinforcement Learning with Experience Replay for LLM Reasoning";
kept as recent off-policy rollouts, ReMix, Liang et al. 2025, "Squeeze the Soaked Sponge:
Efficient Off-policy Reinforcement Finetuning for LLMs"). Once it holds k =
round(``train.replay.fraction`` · G) groups (``config.replay_groups``), step t samples
G - k fresh groups and draws k of the buffer's n groups uniformly without replacement
(each held group is in the step with probability k / n) from the generator seeded by
(``train.seed``, t, ``Stream.REPLAY``); then its fresh informative groups are added, the
oldest overwritten first. A drawn group stays in the buffer until it is overwritten.

G stays fixed, so the update batch keeps its static shape and only the rollouts per step
fall (by k groups). The replayed groups keep their recorded behaviour log-probs and
per-token versions: the objective's correction (truncated IS, decoupled PPO, M2PO, ...)
and the staleness metrics see their age; the learner recomputes the proximal log-probs as
for any batch. The buffer is part of the checkpoint (``ProducerState.replay``), so a resumed
run replays exactly what the uninterrupted run replays.

The buffer keeps each group's prompt ids (``Scored.prompts`` / ``prompt_lens``) with its
rows, so a replayed group reaches the learner as it was sampled, never tokenized again.

Shapes (package legend): G groups, M samples per prompt, P prompt bucket
(``Setup.prompt_len``), R new tokens, C named reward components; ``capacity`` the groups
the buffer holds at most, k the replayed groups of a step.
"""

from __future__ import annotations

import numpy as np

from rl_jax import config as config_lib
from rl_jax import settings
from rl_jax.errors import ConfigError

__all__ = ["METRICS", "enabled", "empty_buffer", "informative", "add", "draw", "merge"]

# Scored.stats keys the learner copies into the step's metrics
METRICS = ("replay_groups", "replay_size", "replay_token_age")

# the buffer's arrays of a group's prompt (leading axis [capacity]; int32)
_GROUPS = ("indices", "prompts", "prompt_lens")
# the buffer's per-group arrays of its rows (leading axis [capacity]) and their dtypes
_ROWS = {"tokens": np.int32, "mask": np.bool_, "logprobs": np.float32, "versions": np.int32}


def enabled(train: settings.TrainSettings) -> bool:
  """Whether the run replays (``train.replay.capacity`` > 0)."""
  return train.replay_groups > 0


def empty_buffer(replay: settings.ReplaySettings, geo: config_lib.Geometry, prompt_len: int,
                 components: int = 0, experts: int = 0, processes: int = 1) -> dict:
  """``ProducerState.replay`` of a fresh run: ``{}`` with replay off, else host arrays
  holding nothing: indices int32 [capacity], prompts int32 [capacity,P] (P =
  ``prompt_len``, ``Setup.prompt_len``) and prompt_lens int32 [capacity], tokens / mask /
  logprobs / versions [capacity,M,R] (M, R of ``geo``), rewards float32 [capacity,M],
  components float32 [capacity,M,C] (with C = ``components`` > 0 named reward components),
  size int32 [] (groups held) and next int32 [] (the slot written next)."""
  if not replay.capacity:
    return {}
  what = f"train.replay.capacity={replay.capacity}"
  if experts:
    raise ConfigError(f"{what} is not supported with a mixture-of-experts model (the buffer "
                      "keeps no expert routing records)")
  if processes > 1:
    raise ConfigError(f"{what} is not supported with {processes} processes (one process "
                      "draws the whole batch)")
  n, M, R = replay.capacity, geo.samples, geo.new_tokens
  out = {"indices": np.zeros((n,), np.int32),
         "prompts": np.zeros((n, prompt_len), np.int32),
         "prompt_lens": np.zeros((n,), np.int32),
         **{k: np.zeros((n, M, R), d) for k, d in _ROWS.items()},
         "rewards": np.zeros((n, M), np.float32),
         "size": np.zeros((), np.int32), "next": np.zeros((), np.int32)}
  if components:
    out["components"] = np.zeros((n, M, components), np.float32)
  return out


def informative(rewards: np.ndarray) -> np.ndarray:
  """bool [g]: the groups of rewards [g,M] whose rewards are not all equal."""
  return rewards.max(axis=1) > rewards.min(axis=1)


def add(buffer: dict, scored) -> dict:
  """``buffer`` with the informative groups of ``scored`` (a ``Scored``: indices, prompts,
  prompt_lens [g,...], rows [g·M,R], rewards [g,M]) written in order at its ring position,
  each overwriting the oldest group once it is full (a new dict; ``buffer`` is not
  changed)."""
  keep = np.flatnonzero(informative(scored.rewards))
  out = {k: np.array(v) for k, v in buffer.items()}
  n, M = out["rewards"].shape
  pos, size = int(out["next"]), int(out["size"])
  for g in keep:
    for k in _GROUPS:
      out[k][pos] = getattr(scored, k)[g]
    for k in _ROWS:
      out[k][pos] = getattr(scored, k)[g * M:(g + 1) * M]
    out["rewards"][pos] = scored.rewards[g]
    if "components" in out:
      out["components"][pos] = scored.components[g]
    pos, size = (pos + 1) % n, min(size + 1, n)
  out["next"], out["size"] = np.int32(pos), np.int32(size)
  return out


def draw(buffer: dict, k: int, seed: int) -> dict | None:
  """k groups of ``buffer`` drawn uniformly without replacement by the generator seeded
  ``seed``, as ``Scored`` fields (indices [k], prompts [k,P], prompt_lens [k], tokens /
  mask / logprobs / versions [k·M,R], rewards [k,M], components [k,M,C] or None); None
  when it holds fewer than k (or k = 0)."""
  size = int(buffer["size"]) if buffer else 0
  if k == 0 or size < k:
    return None
  slots = np.random.default_rng(seed).choice(size, size=k, replace=False)
  rows = lambda a: np.asarray(a)[slots].reshape(k * a.shape[1], *a.shape[2:])
  return {**{name: np.asarray(buffer[name])[slots] for name in _GROUPS},
          **{name: rows(buffer[name]) for name in _ROWS},
          "rewards": np.asarray(buffer["rewards"])[slots],
          "components": (np.asarray(buffer["components"])[slots] if "components" in buffer
                         else None)}


def merge(fresh, part: dict | None, buffer: dict, version: int):
  """The step's ``Scored``: the G - k fresh groups of ``fresh`` followed by the k replayed
  groups ``part`` (``draw``), each array in the fresh one's dtype; its stats add
  ``rollout_tokens`` (the fresh tokens sampled), ``replay_groups`` (k), ``replay_size``
  (groups ``buffer`` holds after this step's additions) and ``replay_token_age`` (the
  replayed tokens' mean age in policy versions, at ``version``)."""
  stats = {**fresh.stats, "rollout_tokens": float(np.sum(fresh.mask)),
           "replay_groups": 0.0, "replay_size": float(buffer["size"])}
  if part is None:
    return fresh._replace(stats=stats)
  cat = lambda name: np.concatenate([getattr(fresh, name),
                                     part[name].astype(getattr(fresh, name).dtype)])
  mask = part["mask"].astype(bool)
  stats["replay_groups"] = float(len(part["indices"]))
  stats["replay_token_age"] = float(np.mean(version - part["versions"][mask])
                                    if mask.any() else 0.0)
  arrays = {name: cat(name) for name in (*_GROUPS, "rewards", *_ROWS)}
  if fresh.components is not None:
    arrays["components"] = cat("components")
  return fresh._replace(stats=stats, **arrays)
