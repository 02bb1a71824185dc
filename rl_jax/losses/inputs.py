"""Records that cross the boundary between a trainer and an objective.

* ``ObjectiveInputs``: one step's groups, as every advantage estimator sees them ([G,M,...]).
* ``Advantages``: what an estimator returns.
* ``LossBatch``: per-row loss data ([B,T] with B = G·M, T = R), what ``Objective.loss`` reads;
  ``loss_batch`` builds it from the two records above.

Axis letters: the package legend (``rl_jax/__init__.py``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp

from rl_jax.losses._utils import Array, check_rank

__all__ = ["INPUT_FIELDS", "Advantages", "LossBatch", "ObjectiveInputs", "check_inputs",
           "loss_batch"]


class ObjectiveInputs(NamedTuple):
  """One step's groups as every advantage estimator sees them. G groups, M samples per
  prompt (group size), R response tokens, U turns.

  A multi-turn (agentic) trajectory is one row of R tokens in which the model's turns and
  the environment's observations alternate; ``mask`` is True on model tokens only and
  ``rewards`` is the trajectory's return. The ``turn_*`` fields describe its turns for
  turn-level estimators (GiGPO); U is the most turns of any trajectory, absent turns padded.

  Attributes:
    rewards: float32 [G,M] sequence rewards.
    mask: bool [G,M,R] tokens that enter the loss.
    generated_mask: bool [G,M,R] every generated token (a superset of ``mask``; differs when
      stale tokens are masked from the loss); None means equal to ``mask``.
    reward_components: float32 [G,M,C] per-component rewards (GDPO); C >= 1.
    lengths: float32 [G,M] number of loss tokens per sample.
    old_logp: float32 [G,M,R] proximal policy log-probs (trainer weights at the start of the
      step).
    behaviour_logp: float32 [G,M,R] sampler log-probs (mu).
    ref_logp: float32 [G,M,R] reference policy log-probs.
    values: float32 [G,M,R] critic values at rollout time.
    grad_sq_norms: float32 [G,M] per-trajectory squared gradient norms of the summed
      log-probs (VCPO).
    turn_rewards: float32 [G,M,U] reward of each turn; NaN for absent turns.
    turn_ids: int32 [G,M,R] turn (0..U-1) each token belongs to; -1 on environment
      (observation) tokens and padding.
    turn_states: int32 [G,M,U] id of the environment state each turn starts from (e.g. a
      hash of the observation), equal ids meaning the same state; -1 for absent turns
      (GiGPO's anchor states).
    teacher_logp: float32 [G,M,R] a frozen teacher's log-probs of the sampled tokens
      (on-policy distillation).
  """

  rewards: Array                          # [G,M]
  mask: Array                             # [G,M,R]
  generated_mask: Array | None = None     # [G,M,R]
  reward_components: Array | None = None  # [G,M,C]
  lengths: Array | None = None            # [G,M]
  old_logp: Array | None = None           # [G,M,R]
  behaviour_logp: Array | None = None     # [G,M,R]
  ref_logp: Array | None = None           # [G,M,R]
  values: Array | None = None             # [G,M,R]
  grad_sq_norms: Array | None = None      # [G,M]
  turn_rewards: Array | None = None       # [G,M,U]
  turn_ids: Array | None = None           # [G,M,R]
  turn_states: Array | None = None        # [G,M,U]
  teacher_logp: Array | None = None       # [G,M,R]


INPUT_FIELDS = ObjectiveInputs._fields

_TOKEN_FIELDS = ("generated_mask", "old_logp", "behaviour_logp", "ref_logp", "values",
                 "turn_ids", "teacher_logp")
_ROW_FIELDS = ("lengths", "grad_sq_norms")
_TURN_FIELDS = ("turn_rewards", "turn_states")  # [G,M,U], one U
_INT_FIELDS = ("turn_ids", "turn_states")


class Advantages(NamedTuple):
  """An estimator's result.

  Attributes:
    advantages: float [G,M] sequence-level or [G,M,R] token-level advantages.
    returns: float [G,M,R] value targets (GAE), else None.
    keep: bool [G,M] rows that train (MC-GRPO drops its pivot row); None means all rows.
  """

  advantages: Array
  returns: Array | None = None
  keep: Array | None = None


class LossBatch(NamedTuple):
  """Per-row training data for one (micro-)batch; a pytree, sliceable along rows.

  Attributes:
    mask: bool [B,T] tokens that enter the loss.
    advantages: float [B] (sequence) or [B,T] (token) advantages.
    old_logp: float [B,T] log-probs the ratio is taken against (the trainer's weights at the
      start of the step, i.e. the proximal policy).
    behaviour_logp: float [B,T] the sampler's log-probs (mu); None means equal to old_logp.
    ref_logp: float [B,T] reference-policy log-probs, or None.
    values: float [B,T] current value predictions (PPO), or None (may be passed to ``loss``).
    returns: float [B,T] value targets (PPO), or None.
    old_values: float [B,T] value predictions at rollout time (PPO), or None.
    aux: dict of batch-global precomputations with leading axis B, filled by
      ``Objective.prepare`` on the whole minibatch before micro-batching; or None.
  """

  mask: Array
  advantages: Array
  old_logp: Array
  behaviour_logp: Array | None = None
  ref_logp: Array | None = None
  values: Array | None = None
  returns: Array | None = None
  old_values: Array | None = None
  aux: dict[str, Array] | None = None


def _shape_error(name: str, x: Array, want: str, got_ref: tuple) -> ValueError:
  return ValueError(f"ObjectiveInputs.{name} has shape {tuple(x.shape)}, expected {want} = "
                    f"{got_ref}")


def check_inputs(inputs: ObjectiveInputs, needs: tuple[str, ...] = (), who: str = "") -> None:
  """Raises ValueError unless ``inputs`` is an ObjectiveInputs with consistent [G,M,R] (and
  [G,M,U]) shapes, integer turn ids and states, and every field named in ``needs`` present
  (not None).

  Args:
    inputs: the record to check.
    needs: ObjectiveInputs fields that must not be None.
    who: label for the error message (e.g. the estimator's name).
  """
  if not isinstance(inputs, ObjectiveInputs):
    raise ValueError(f"expected losses.ObjectiveInputs, got {type(inputs).__name__}")
  check_rank("ObjectiveInputs.rewards", inputs.rewards, (2,))
  check_rank("ObjectiveInputs.mask", inputs.mask, (3,))
  gm = tuple(inputs.rewards.shape)
  gmr = tuple(inputs.mask.shape)
  if gmr[:2] != gm:
    raise _shape_error("mask", inputs.mask, "[G,M,R] with [G,M] of rewards", gm + ("R",))
  for name in _TOKEN_FIELDS:
    x = getattr(inputs, name)
    if x is not None and tuple(x.shape) != gmr:
      raise _shape_error(name, x, "[G,M,R] of mask", gmr)
  for name in _ROW_FIELDS:
    x = getattr(inputs, name)
    if x is not None and tuple(x.shape) != gm:
      raise _shape_error(name, x, "[G,M] of rewards", gm)
  comps = inputs.reward_components
  if comps is not None and (comps.ndim != 3 or tuple(comps.shape[:2]) != gm):
    raise _shape_error("reward_components", comps, "[G,M,C]", gm + ("C",))
  gmu = None
  for name in _TURN_FIELDS:
    x = getattr(inputs, name)
    if x is None:
      continue
    if x.ndim != 3 or tuple(x.shape[:2]) != gm or (gmu is not None and tuple(x.shape) != gmu):
      raise _shape_error(name, x, "[G,M,U] (one U for every turn field)",
                         gmu or gm + ("U",))
    gmu = tuple(x.shape)
  for name in _INT_FIELDS:
    x = getattr(inputs, name)
    if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"ObjectiveInputs.{name} must be integer, got {x.dtype}")
  missing = [n for n in needs if getattr(inputs, n) is None]
  if missing:
    label = f"{who!r} " if who else ""
    raise ValueError(f"advantage estimator {label}needs {missing} in ObjectiveInputs")


def loss_batch(inputs: ObjectiveInputs, adv: Advantages) -> LossBatch:
  """Flatten groups to rows ([G,M,...] -> [G·M,...]) for ``Objective.loss``.

  The loss mask is ``inputs.mask`` restricted to the rows ``adv.keep`` (all rows if None);
  ``old_values`` are the rollout-time ``inputs.values``; ``returns`` come from the
  estimator. Jittable (shapes only).

  Args:
    inputs: the step's ObjectiveInputs; ``old_logp`` is required (the ratio's denominator).
    adv: the estimator's result for ``inputs``.

  Returns:
    A ``LossBatch`` with B = G·M rows and T = R tokens (``aux`` and ``values`` left None).
  """
  check_inputs(inputs, ("old_logp",), "loss_batch")
  g, m, r = inputs.mask.shape
  if tuple(adv.advantages.shape) not in ((g, m), (g, m, r)):
    raise ValueError(f"Advantages.advantages has shape {tuple(adv.advantages.shape)}, "
                     f"expected [G,M] = {(g, m)} or [G,M,R] = {(g, m, r)}")
  if adv.returns is not None and tuple(adv.returns.shape) != (g, m, r):
    raise ValueError(f"Advantages.returns has shape {tuple(adv.returns.shape)}, expected "
                     f"[G,M,R] = {(g, m, r)}")
  mask = inputs.mask.astype(bool)
  if adv.keep is not None:
    if tuple(adv.keep.shape) != (g, m):
      raise ValueError(f"Advantages.keep has shape {tuple(adv.keep.shape)}, expected "
                       f"[G,M] = {(g, m)}")
    mask = mask & adv.keep.astype(bool)[..., None]

  def rows(x):
    return None if x is None else x.reshape(g * m, *x.shape[2:])

  return LossBatch(mask=rows(mask), advantages=rows(adv.advantages),
               old_logp=rows(inputs.old_logp), behaviour_logp=rows(inputs.behaviour_logp),
               ref_logp=rows(inputs.ref_logp), returns=rows(adv.returns),
               old_values=rows(inputs.values))
