"""The prompt-selection stage of a step: which prompts are rolled out, and which groups train.

``data.selector``:

* ``"none"``: the next G prompts of the seeded sampler.
* ``"dapo"`` (DAPO dynamic sampling): roll out G prompts at a time and keep the groups whose
  rewards are not all equal, until G such groups are ready or ``data.max_tries`` batches
  were drawn. A batch that is still short is filled with the earliest zero-variance groups
  (they carry zero advantage) and the step reports ``dynamic_sampling_short`` (how many).
  Chosen groups keep their draw order, so ``data.max_tries=1`` is plain sampling.
* ``"greso"``: pre-rollout skipping from per-prompt zero-variance streaks
  (``rl_jax.data.selection.greso_select``); the streaks and the two exploration
  probabilities live in ``TrainState.selector``.
* ``data.group_size="adaptive"`` (with selector none or beta): the G prompts get k_i chunks
  of m samples each from their Beta posteriors (``rl_jax.train.group_size``); the rolled
  out ``Scored`` has W = G·M/m chunks and ``groups`` (the prompt of each chunk).
* ``"beta"``: draw ``ceil(data.select_pool · G)`` candidates, roll out the G best by their
  Beta posterior (``data.beta_mode``), then update every posterior with decay
  ``data.beta_decay`` (successes: rewards > 0.5).

With ``loss.preset="dapo"`` and ``data.selector="none"`` the selector is ``"dapo"`` (unless
``rollout.partial``), and ``data.overlong_buffer`` unset means ``max_new_tokens // 4``.

Every draw is a function of (train.seed, step, stream); the per-prompt state is part of
the checkpoint, so a resumed run selects exactly what the uninterrupted run selects.

Shapes (package legend): G groups, M samples per prompt, R new tokens; I train prompts.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import numpy as np

from rl_jax import config as config_lib
from rl_jax import settings
from rl_jax.data import rewards as rewards_lib
from rl_jax.data import selection
from rl_jax.train import group_size
from rl_jax.train.streams import Stream, seed_for

__all__ = ["METRICS", "Selection", "effective_selector", "overlong_buffer",
           "make_selection", "overlong_penalties", "selector_state", "shape_rewards",
           "take_groups", "select"]

# Scored.stats keys the learner copies into the step's metrics (docs/SELECTION.md)
METRICS = ("skipped_prompts", "selected_prompts", "dynamic_sampling_tries",
           "dynamic_sampling_short", "dynamic_sampling_dropped", "rollout_tokens",
           "informative_groups", "rollout_tokens_per_informative_group",
           "effective_prompts_per_s", "spec_drafted_samples", "spec_accept_len",
           "spec_reused_tokens", "spec_reused_token_fraction")

GRESO_P0 = 0.5  # initial exploration probability of both GRESO kinds


def effective_selector(selector: str, preset: str, partial: bool) -> str:
  """The selector a run uses: ``data.selector``, or ``"dapo"`` for the dapo preset
  (``loss.preset``) unless the partial-rollout engine (``rollout.partial``) draws the
  prompts."""
  if selector == "none" and preset == "dapo" and not partial:
    return "dapo"
  return selector


def overlong_buffer(setting: int | None, preset: str, max_new_tokens: int) -> int:
  """L_cache of DAPO overlong shaping (0 = off): ``data.overlong_buffer`` when set, else a
  quarter of the response budget for the dapo preset."""
  if setting is not None:
    return int(setting)
  return max(1, max_new_tokens // 4) if preset == "dapo" else 0


class Selection(NamedTuple):
  """How a run picks its prompts and shapes their rewards, decided once (``Setup.selection``).

  kind: the selector (``effective_selector``: "none", "dapo", "greso", "beta"). overlong:
  L_cache of DAPO's overlong shaping (0: off). max_new_tokens: R, where the penalty ends.
  seed: the selector's random stream. data: the data settings (tries, pool, Beta mode and
  decay, the prompt stream's seed).
  """

  kind: str
  overlong: int
  max_new_tokens: int
  seed: int
  data: settings.DataSettings


def make_selection(data: settings.DataSettings, preset: str, rollout: settings.RolloutSettings,
              train_seed: int) -> Selection:
  """The ``Selection`` of a run with these settings and ``loss.preset``."""
  R = rollout.max_new_tokens
  return Selection(effective_selector(data.selector, preset, rollout.partial),
                   overlong_buffer(data.overlong_buffer, preset, R), R,
                   seed_for(train_seed, 0, Stream.SELECTOR), data)


def overlong_penalties(sel: Selection, lengths: np.ndarray) -> np.ndarray:
  """DAPO's overlong penalty of response lengths [B]: float32 [B], zeros when it is off."""
  if not sel.overlong:
    return np.zeros(np.shape(lengths), np.float32)
  return np.asarray(rewards_lib.overlong_penalty(lengths, sel.max_new_tokens, sel.overlong),
                    np.float32)


def shape_rewards(sel: Selection, rewards: np.ndarray, lengths: np.ndarray) -> np.ndarray:
  """Task rewards [B] plus the overlong penalty of response lengths [B] (when on)."""
  if not sel.overlong:
    return rewards
  return (rewards + overlong_penalties(sel, lengths)).astype(np.float32)


def selector_state(kind: str, adaptive: bool, num_prompts: int) -> dict:
  """``TrainState.selector`` of a fresh run with the selector ``kind`` (``Selection.kind``)
  and, if ``adaptive``, adaptive group sizes (host arrays; ``{}`` without per-prompt state).

  greso: streak int32 [I], kind int8 [I], p float32 [2] (p_easy, p_hard).
  beta (and adaptive group size): alpha, beta float32 [I] at the Beta(1, 1) prior.
  """
  if kind == "greso":
    return {"streak": np.zeros(num_prompts, np.int32), "kind": np.zeros(num_prompts, np.int8),
            "p": np.full(2, GRESO_P0, np.float32)}
  if kind == "beta" or adaptive:
    return {"alpha": np.ones(num_prompts, np.float32), "beta": np.ones(num_prompts, np.float32)}
  return {}


def take_groups(parts: list, picks: list[tuple[int, int]]):
  """A ``Scored`` of the groups ``picks`` = [(part, group)] of the ``Scored`` ``parts``."""
  M = parts[0].rewards.shape[1]
  rows = lambda name: np.concatenate([getattr(parts[p], name)[g * M:(g + 1) * M]
                                      for p, g in picks])
  stats = {}
  for p in parts:
    for k, v in p.stats.items():
      stats[k] = stats.get(k, 0.0) + float(v)
  comps = None if parts[0].components is None else np.stack(
      [parts[p].components[g] for p, g in picks]).astype(np.float32)
  return parts[0]._replace(components=comps,
      indices=np.asarray([parts[p].indices[g] for p, g in picks], np.int32),
      prompts=np.stack([parts[p].prompts[g] for p, g in picks]).astype(np.int32),
      prompt_lens=np.asarray([parts[p].prompt_lens[g] for p, g in picks], np.int32),
      tokens=rows("tokens"), mask=rows("mask"), logprobs=rows("logprobs"),
      versions=rows("versions"),
      rewards=np.stack([parts[p].rewards[g] for p, g in picks]).astype(np.float32),
      faults=np.sum([p.faults for p in parts], axis=0).astype(np.int64),
      rollout_s=float(sum(p.rollout_s for p in parts)), stats=stats)


def _dapo(sel: Selection, G: int, data, next_indices, roll):
  parts, informative = [], []
  for attempt in range(sel.data.max_tries):
    idx, data = next_indices(data, G)
    sc = roll(idx, attempt * G)
    parts.append(sc)
    keep = selection.dynamic_sampling_mask(sc.rewards)
    informative += [(attempt, g) for g in np.flatnonzero(keep)]
    if len(informative) >= G:
      break
  inf = informative[:G]
  chosen = set(inf)
  rest = [(p, g) for p in range(len(parts)) for g in range(G) if (p, g) not in chosen]
  picks = sorted(inf + rest[:G - len(inf)])  # draw order
  out = take_groups(parts, picks)
  drawn = len(parts) * G
  stats = {"dynamic_sampling_tries": float(len(parts)),
           "dynamic_sampling_short": float(G - len(inf)),
           "dynamic_sampling_dropped": float(drawn - G),
           "selected_prompts": float(drawn), "skipped_prompts": 0.0}
  return out, data, None, stats


def _greso(how: Selection, G: int, data, sel, roll, step):
  gs = selection.GresoState(sel["streak"], sel["kind"], float(sel["p"][0]),
                            float(sel["p"][1]), how.seed)
  sampler = selection.SamplerState(int(how.data.seed), int(data[0]), int(data[1]))
  idx, sampler, skipped = selection.greso_select(sampler, gs, G, step, how.data.max_tries)
  out = roll(idx, 0)
  gs = selection.greso_update(gs, idx, out.rewards)
  new = {"streak": gs.streak.astype(np.int32), "kind": gs.kind.astype(np.int8),
         "p": np.asarray([gs.p_easy, gs.p_hard], np.float32)}
  return (out, np.asarray([sampler.epoch, sampler.position], np.int32), new,
          {"skipped_prompts": float(skipped), "selected_prompts": float(G)})


def _beta_state(how: Selection, sel) -> selection.BetaState:
  return selection.BetaState(sel["alpha"].astype(np.float64), sel["beta"].astype(np.float64),
                             1.0, 1.0, float(how.data.beta_decay), how.seed)


def _beta_update(bs, idx, out, groups, counts) -> dict:
  """Posterior update from the rolled-out rows (successes: reward > 0.5) of prompts ``idx``."""
  k = np.sum(out.rewards > 0.5, axis=1).astype(np.float64)
  if groups is not None:  # chunks -> prompts
    k = np.bincount(groups, weights=k, minlength=len(idx))
  bs = selection.beta_update(bs, idx, k, counts)
  return {"alpha": bs.alpha.astype(np.float32), "beta": bs.beta.astype(np.float32)}


def _beta(how: Selection, geo: config_lib.Geometry, data, sel, next_indices, roll, step):
  G, M = geo.groups, geo.samples
  pool = math.ceil(how.data.select_pool * G)
  cand, data = next_indices(data, pool)
  bs = _beta_state(how, sel)
  chosen = selection.beta_select(bs, G, step, candidates=cand, mode=how.data.beta_mode)
  out = roll(chosen, 0)
  new = _beta_update(bs, chosen, out, None, np.full(G, float(M)))
  return out, data, new, {"skipped_prompts": float(pool - G), "selected_prompts": float(G)}


def _adaptive(how: Selection, geo: config_lib.Geometry, data, sel, next_indices, roll, step):
  """Adaptive group size (``rl_jax.train.group_size``): G prompts (the sampler's next, or the
  Beta selector's choice), k_i chunks of m samples each from their posteriors."""
  G, W, m = geo.groups, geo.rows, geo.row_size
  bs = _beta_state(how, sel)
  if how.kind == "beta":
    pool = math.ceil(how.data.select_pool * G)
    cand, data = next_indices(data, pool)
    idx = selection.beta_select(bs, G, step, candidates=cand, mode=how.data.beta_mode)
  else:
    pool = G
    idx, data = next_indices(data, G)
  k = group_size.allocate(bs.alpha[idx], bs.beta[idx], W, m, geo.max_chunks)
  groups = np.repeat(np.arange(G), k).astype(np.int32)
  out = roll(np.repeat(idx, k), 0)._replace(groups=groups)
  new = _beta_update(bs, idx, out, groups, (k * m).astype(np.float64))
  mixed = group_size.prompt_spread(out.rewards, groups)
  stats = {"skipped_prompts": float(pool - G), "selected_prompts": float(G),
           "group_size_min": float(k.min() * m), "group_size_max": float(k.max() * m),
           "group_size_mixed_mean": float((k * m)[mixed].mean()) if mixed.any() else 0.0}
  return out, data, new, stats


def select(how: Selection, geo: config_lib.Geometry, data: np.ndarray, sel: dict,
           next_indices: Callable, roll: Callable, step: int
           ) -> tuple[Any, np.ndarray, dict | None, dict]:
  """Choose and roll out one step's G groups with the run's selector.

  Args:
    how: the run's ``Selection``. geo: the step's geometry (G groups; adaptive group size).
    data: int32 [2] sampler position. sel: ``TrainState.selector`` (host).
    next_indices: ``(data, n) -> (indices [n], data')`` the seeded sampler.
    roll: ``(indices [g], first_index) -> Scored`` samples and scores groups (``first_index``
      picks their key streams).
    step: the step (randomness of the selector).
  Returns:
    (the ``Scored`` G groups, the new sampler position, the new selector state or None,
    the selection metrics).
  """
  kind, G = how.kind, geo.groups
  if geo.adaptive:
    out, data, new, stats = _adaptive(how, geo, data, sel, next_indices, roll, step)
  elif kind == "dapo":
    out, data, new, stats = _dapo(how, G, data, next_indices, roll)
  elif kind == "greso":
    out, data, new, stats = _greso(how, G, data, sel, roll, step)
  elif kind == "beta":
    out, data, new, stats = _beta(how, geo, data, sel, next_indices, roll, step)
  else:
    idx, data = next_indices(data, G)
    out, new, stats = roll(idx, 0), None, {"selected_prompts": float(len(idx)),
                                           "skipped_prompts": 0.0}
  return out, data, new, stats
