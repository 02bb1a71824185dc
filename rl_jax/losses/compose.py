"""Composable objectives: parts combined with ``chain(...)``, like optax.

An objective is built from

* one advantage estimator (``grpo()``, ``rloo()``, ``opob()`` ..., see ``estimators.py``):
  ``ObjectiveInputs -> Advantages``, run once per batch before the loss;
* loss stages (``ppo_clip()``, ``truncated_is()``, ``kl_term()`` ..., see ``stages.py``);
* one aggregation (``aggregation("token-mean")``): per-token loss -> (sum, denominator);
* optionally an optax transform applied after the optimiser (``scale_by_ess()``).

The per-token loss is ``where(keep, w * l, 0) + extra`` and ``loss = sum / denom``.

    obj = chain(grpo(), ppo_clip(0.2, 0.28), kl_term(0.001), aggregation("token-mean"))
    adv = obj.advantages(rewards)                            # [G,M] -> [G,M]
    loss_sum, denom, metrics = obj.loss(logp, batch)         # differentiable in logp

A trainer fills the ``ObjectiveInputs`` fields named in ``obj.needs``, then

    adv = obj.advantages_from(inputs)                        # Advantages
    batch = obj.prepare(loss_batch(inputs, adv))             # [G,M,...] -> rows

Named recipes are ``get_objective("dapo")`` (presets.py), each one ``chain`` of these parts.
``policy_loss`` is the aggregated clipped loss as a plain function (the same stages).

Axis letters: G groups, M samples per prompt, R response tokens, B rows (= G·M), T tokens.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rl_jax import sharding
from rl_jax.losses import policy as pol
from rl_jax.losses import vcpo as vcpo_lib
from rl_jax.losses._utils import (Array, check_rank, check_same_shape, masked_mean,
                                  safe_divide)
from rl_jax.losses.aggregation import Aggregation, aggregation
from rl_jax.losses.estimators import AdvantageEstimator
from rl_jax.losses.inputs import INPUT_FIELDS, Advantages, LossBatch, ObjectiveInputs
from rl_jax.losses.stages import LossInputs, LossStage, LossTerms, ppo_clip

__all__ = ["Objective", "chain", "finalize", "policy_loss"]

_TOKEN_AXES = ("batch", "length")

# LossStage.needs (loss-time names) -> the ObjectiveInputs field behind it; None for what
# every loss has. Other names (a custom stage's own inputs) are kept as they are.
_STAGE_NEEDS = {"old_values": "values", "returns": "values", "logp": None, "mask": None,
                "advantages": None, "aux": None}


class Objective(NamedTuple):
  """A composed objective.

  Attributes:
    advantages: ``(rewards, **fields)`` convenience form of ``advantages_from``. Given an
      ``ObjectiveInputs`` it returns its ``Advantages``. Given a rewards array [G,M] and any
      other ObjectiveInputs fields as keywords it returns only the advantages array ([G,M]
      or [G,M,R]); ``mask`` defaults to one loss token per sample (ones [G,M,1]), enough
      for the sequence-level estimators. Use the record form to get ``returns`` (GAE) or
      ``keep`` (MC-GRPO).
    loss: ``(logp [B,T], batch, *, values=None, entropy=None) -> (loss_sum, denom, metrics)``;
      pure and jittable; differentiate ``loss_sum / denom`` (see ``finalize``). Over
      micro-batches, sum loss_sum and denom separately and divide once.
    prepare: ``batch -> batch`` filling ``batch.aux`` with batch-global quantities (M2PO);
      call it on the whole minibatch before splitting into micro-batches.
    update_transform: optax transform to chain after the optimiser; accepts ``ess_ratio=``.
    default_agg: the aggregation mode.
    uses_kl: a KL term in the loss, or an estimator that reads ``ref_logp`` (KL in the reward).
    needs_ref / needs_values / needs_entropy / needs_grad_norms (properties): ``"ref_logp"``,
      ``"values"``, ``"entropy"``, ``"grad_sq_norms"`` in ``needs``.
    name: preset name or "custom".
    estimator: name of the advantage estimator (None if there is none).
    advantages_from: ``(ObjectiveInputs) -> Advantages`` of the chained estimator; checks
      shapes and that the estimator's needs are present.
    estimator_needs: the ObjectiveInputs fields the advantage estimator declares it reads.
    needs: every input the objective reads besides ``rewards`` and ``mask``: the
      ObjectiveInputs fields of the estimator and of the loss stages (always ``old_logp``,
      the ratio's denominator; ``ref_logp`` for a KL term or ACE; ``behaviour_logp`` for
      TIS, MIS, IcePop, geometric-mean IS, MinPRO, decoupled PPO, M2PO and ESS metrics;
      ``values`` for GAE and the value loss) and
      ``"entropy"``, the per-token entropy ``loss(..., entropy=)`` needs for an entropy
      bonus. A trainer rejects a config with ``objective.needs - PROVIDED``.
    batch_global: a stage computes a statistic over the whole minibatch in ``prepare``
      (M2PO's mask), so splitting the minibatch into micro-batches changes the loss.
    single_pass: a stage's surrogate is the policy gradient only on the data's own policy
      (``LossStage.single_pass``, plain REINFORCE), so the objective cannot take several
      passes over one batch (a trainer refuses ``train.epochs > 1``).
  """

  advantages: Callable[..., Any]
  loss: Callable[..., tuple[Array, Array, dict]]
  prepare: Callable[[LossBatch], LossBatch]
  update_transform: optax.GradientTransformationExtraArgs
  default_agg: str
  uses_kl: bool
  name: str = "custom"
  estimator: str | None = None
  advantages_from: Callable[[ObjectiveInputs], Advantages] | None = None
  needs: frozenset[str] = frozenset({"old_logp"})
  estimator_needs: frozenset[str] = frozenset()
  batch_global: bool = False
  single_pass: bool = False

  @property
  def needs_ref(self) -> bool:
    return "ref_logp" in self.needs

  @property
  def needs_values(self) -> bool:
    return "values" in self.needs

  @property
  def needs_entropy(self) -> bool:
    return "entropy" in self.needs

  @property
  def needs_grad_norms(self) -> bool:
    return "grad_sq_norms" in self.needs


def finalize(loss_sum: Array, denom: Array) -> Array:
  """``loss_sum / denom``; 0.0 when nothing was valid (documented result, never NaN)."""
  return safe_divide(loss_sum, denom)


def _sanitize(x: Array | None, mask: Array) -> Array | None:
  if x is None:
    return None
  return sharding.constrain(jnp.where(mask, x, 0.0), _TOKEN_AXES)


def _check_batch(logp: Array, batch: LossBatch, values, entropy) -> None:
  if not isinstance(batch, LossBatch):
    raise ValueError(f"batch must be a losses.LossBatch, got {type(batch).__name__}")
  check_rank("logp", logp, (2,))
  check_same_shape("logp", logp, mask=batch.mask, old_logp=batch.old_logp,
                   behaviour_logp=batch.behaviour_logp, ref_logp=batch.ref_logp,
                   values=values, returns=batch.returns, old_values=batch.old_values,
                   entropy=entropy)
  pol.broadcast_advantages(batch.advantages, logp.shape)


def _split_parts(parts: tuple[Any, ...]):
  """``(estimator | None, stages, aggregation, tx)`` of ``chain``'s arguments, checked."""
  kinds = (AdvantageEstimator, LossStage, Aggregation, optax.GradientTransformation)
  other = [p for p in parts if not isinstance(p, kinds)]
  if other:
    raise ValueError(f"chain() got an unsupported part of type {type(other[0]).__name__}")
  estimators, stages, aggs, txs = ([p for p in parts if isinstance(p, k)] for k in kinds)
  if len(estimators) > 1 or len(aggs) > 1 or len(txs) > 1:
    raise ValueError("chain() takes at most one advantage estimator, aggregation and "
                     "update transform")
  if sum(s.kind == "policy" for s in stages) > 1:
    raise ValueError("chain() takes at most one policy stage (ppo_clip, gspo_clip, reinforce, "
                     "m2po_clip_budget)")
  tx = txs[0] if txs else vcpo_lib.identity_transform()
  if not isinstance(tx, optax.GradientTransformationExtraArgs):
    tx = optax.with_extra_args_support(tx)
  return (estimators[0] if estimators else None, stages,
          aggs[0] if aggs else aggregation(), tx)


def _advantage_fns(estimator: AdvantageEstimator | None):
  """``(advantages_from, advantages)`` of ``Objective`` for ``estimator``."""

  def advantages_from(inputs: ObjectiveInputs) -> Advantages:
    if estimator is None:
      raise ValueError("this objective has no advantage estimator; pass one to chain()")
    out = estimator.compute(inputs)
    if not isinstance(out, Advantages):
      raise ValueError(f"advantage estimator {estimator.name!r} returned "
                       f"{type(out).__name__}, expected losses.Advantages")
    return out

  def advantages(rewards, **fields):
    if isinstance(rewards, ObjectiveInputs):
      if fields:
        raise ValueError("pass either an ObjectiveInputs or rewards with keyword fields")
      return advantages_from(rewards)
    unknown = sorted(set(fields) - set(INPUT_FIELDS))
    if unknown:
      raise ValueError(f"unknown ObjectiveInputs field(s) {unknown}; valid: "
                       f"{list(INPUT_FIELDS)}")
    rewards = jnp.asarray(rewards)
    if fields.get("mask") is None:
      fields["mask"] = jnp.ones(rewards.shape + (1,), bool)
    return advantages_from(ObjectiveInputs(rewards=rewards, **fields)).advantages

  return advantages_from, advantages


def chain(*parts: Any, name: str = "custom") -> Objective:
  """Compose an advantage estimator, loss stages, an aggregation and an update transform.

  Args:
    *parts: at most one AdvantageEstimator, any LossStages (at most one policy stage), at
      most one Aggregation (default token-mean) and at most one optax transform (applied
      after the optimiser; default identity).
    name: label stored on the objective.

  Returns:
    An ``Objective``.

  References: Design follows optax's chain of GradientTransformations.
  """
  estimator, stages, agg, tx = _split_parts(parts)
  est_needs = set(estimator.needs) if estimator else set()
  stage_needs = {_STAGE_NEEDS.get(n, n) for s in stages for n in s.needs}
  needs = frozenset(({"old_logp"} | est_needs | stage_needs) - {None})
  uses_kl = "ref_logp" in est_needs or any(
      s.kind == "term" and "ref_logp" in s.needs for s in stages)
  advantages_from, advantages = _advantage_fns(estimator)

  def prepare(batch: LossBatch) -> LossBatch:
    aux = dict(batch.aux or {})
    for s in stages:
      if s.prepare is not None:
        aux.update(s.prepare(batch))
    return batch._replace(aux=aux)

  def loss(logp: Array, batch: LossBatch, *, values: Array | None = None,
           entropy: Array | None = None) -> tuple[Array, Array, dict]:
    values = batch.values if values is None else values
    _check_batch(logp, batch, values, entropy)
    mask = sharding.constrain(batch.mask.astype(bool), _TOKEN_AXES)
    old = _sanitize(batch.old_logp, mask)
    mu = old if batch.behaviour_logp is None else _sanitize(batch.behaviour_logp, mask)
    adv = pol.broadcast_advantages(batch.advantages, logp.shape)
    x = LossInputs(
        logp=_sanitize(logp, mask), mask=mask, advantages=_sanitize(adv, mask),
        old_logp=old, behaviour_logp=mu, ref_logp=_sanitize(batch.ref_logp, mask),
        values=_sanitize(values, mask), returns=_sanitize(batch.returns, mask),
        old_values=_sanitize(batch.old_values, mask), entropy=_sanitize(entropy, mask),
        aux=dict(batch.aux or {}))
    missing = sorted({n for s in stages for n in s.needs
                      if n in LossInputs._fields and getattr(x, n) is None})
    if missing:
      raise ValueError(f"this objective needs {missing} (in the LossBatch or as loss kwargs)")
    fmask = mask.astype(logp.dtype)
    terms = LossTerms(policy=jnp.zeros_like(x.logp), weight=fmask, keep=mask,
                      extra=jnp.zeros_like(x.logp), metrics={})
    for s in stages:
      terms = s.apply(terms, x)
    per_token = jnp.where(terms.keep, terms.weight * terms.policy, 0.0) + terms.extra
    loss_sum, denom = agg.reduce(per_token, mask)
    n_tok = jnp.sum(fmask)
    gap = jnp.abs(old - mu)
    metrics = dict(
        terms.metrics,
        num_tokens=n_tok,
        num_seqs=jnp.sum(jnp.any(mask, axis=1)).astype(jnp.float32),
        masked_frac=1.0 - safe_divide(jnp.sum(terms.keep & mask), n_tok),
        mismatch_mean=masked_mean(gap, mask),
        mismatch_max=jnp.max(jnp.where(mask, gap, 0.0)),
        loss=finalize(loss_sum, denom),
    )
    return loss_sum, denom, jax.lax.stop_gradient(metrics)

  return Objective(
      advantages=advantages, loss=loss, prepare=prepare, update_transform=tx,
      default_agg=agg.mode, uses_kl=uses_kl, name=name,
      estimator=estimator.name if estimator else None, advantages_from=advantages_from,
      needs=needs, estimator_needs=frozenset(est_needs),
      batch_global=any(s.prepare is not None for s in stages),
      single_pass=any(s.single_pass for s in stages))


_POLICY_LOSS_METRICS = ("clip_frac", "approx_kl", "ratio_mean", "num_tokens")


def policy_loss(logp: Array, old_logp: Array, advantages: Array, mask: Array,
                eps_low: float = 0.2, eps_high: float = 0.2, dual_clip=None,
                ratio_level: str = "token", agg: str = "token-mean",
                agg_norm: float | None = None) -> tuple[Array, dict]:
  """Clipped policy loss (PPO / DAPO clip-higher / dual clip / GSPO), aggregated.

  The plain-function form of ``chain(ppo_clip(...), aggregation(agg, agg_norm))``.

  Args:
    logp: float [B,T] current log-probs (differentiated).
    old_logp: float [B,T] log-probs the ratio is taken against.
    advantages: float [B] or [B,T].
    mask: bool [B,T].
    eps_low, eps_high: clip range.
    dual_clip: None, True (c = 3) or the bound c > 1 (token level only).
    ratio_level: "token" (PPO) or "sequence" (GSPO).
    agg: aggregation mode (see ``aggregate_parts``).
    agg_norm: C for seq-mean-token-sum-norm.

  Returns:
    ``(loss, metrics)``; loss is 0.0 for an all-masked batch. metrics: clip_frac,
    approx_kl (mean k3 of current vs old), ratio_mean, num_tokens.

  References: Schulman et al. 2017 (PPO); Yu et al. 2025 (DAPO); Zheng et al. 2025 (GSPO).
  docs/ALGORITHMS.md, "Policy losses".
  """
  obj = chain(ppo_clip(eps_low, eps_high, dual_clip, ratio_level), aggregation(agg, agg_norm),
              name="policy_loss")
  loss_sum, denom, metrics = obj.loss(logp, LossBatch(mask=mask, advantages=advantages,
                                                  old_logp=old_logp))
  return finalize(loss_sum, denom), {k: metrics[k] for k in _POLICY_LOSS_METRICS}
