"""Composable objectives: small stage factories combined with ``chain(...)``, like optax.

An objective is built from

* one advantage estimator (``grpo()``, ``rloo()``, ``opob()`` ...): rewards -> advantages,
  run once per batch before the loss;
* loss stages (``ppo_clip()``, ``truncated_is()``, ``kl_term()`` ...), each a pure function
  ``(LossTerms, LossInputs) -> LossTerms``. A *policy* stage sets the per-token surrogate
  ``l``; *correction* stages multiply a detached weight ``w`` or drop tokens (``keep``);
  *term* stages add unweighted per-token terms (KL, entropy, value loss). Corrections are
  multiplicative and terms additive, so stage order does not matter;
* one aggregation (``aggregation("token-mean")``): per-token loss -> (sum, denominator);
* optionally an optax transform applied after the optimiser (``scale_by_ess()``).

The per-token loss is ``where(keep, w * l, 0) + extra`` and ``loss = sum / denom``.

    obj = chain(grpo(), ppo_clip(0.2, 0.28), kl_term(0.001), aggregation("token-mean"))
    adv = obj.advantages(rewards)                            # [G,N]
    loss_sum, denom, metrics = obj.loss(logp, batch)         # differentiable in logp

Axis letters: G groups, N samples per group, B rows, T tokens.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rl_jax import sharding
from rl_jax.losses import advantages as adv_lib
from rl_jax.losses import policy as pol
from rl_jax.losses import vcpo as vcpo_lib
from rl_jax.losses._utils import (Array, check_choice, check_rank, check_same_shape,
                                  clamped_exp, masked_mean, safe_divide)
from rl_jax.losses.aggregation import AGG_MODES, aggregate_parts
from rl_jax.losses.kl import KL_KINDS, kl_penalty

_TOKEN_AXES = ("batch", "length")


# ----------------------------------------------------------------------------- data
class Batch(NamedTuple):
  """Per-row training data for one (micro-)batch; a pytree, sliceable along rows.

  Attributes:
    mask: bool [B,T] valid response tokens.
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
  aux: dict | None = None


class LossInputs(NamedTuple):
  """Sanitised loss inputs (0 on invalid tokens); what stages read. Shapes [B,T]."""

  logp: Array
  mask: Array
  advantages: Array
  old_logp: Array
  behaviour_logp: Array
  ref_logp: Array | None
  values: Array | None
  returns: Array | None
  old_values: Array | None
  entropy: Array | None
  aux: dict


class LossTerms(NamedTuple):
  """What stages build. ``policy`` l [B,T], ``weight`` w [B,T] (detached), ``keep`` bool
  [B,T], ``extra`` [B,T] additive terms, ``metrics`` dict of scalars."""

  policy: Array
  weight: Array
  keep: Array
  extra: Array
  metrics: dict


class LossStage(NamedTuple):
  """A loss stage: ``apply(terms, inputs) -> terms``; ``prepare(batch) -> aux dict``."""

  apply: Callable[[LossTerms, LossInputs], LossTerms]
  kind: str  # "policy", "correction" or "term"
  needs: tuple[str, ...] = ()
  prepare: Callable[[Batch], dict] | None = None


class AdvantageEstimator(NamedTuple):
  """``compute(rewards, **kwargs)`` -> advantages (see each factory for kwargs)."""

  compute: Callable[..., Any]
  name: str
  needs: tuple[str, ...] = ()


class Aggregation(NamedTuple):
  reduce: Callable[[Array, Array], tuple[Array, Array]]
  mode: str
  norm: float | None = None


class Objective(NamedTuple):
  """A composed objective.

  Attributes:
    advantages: ``(rewards, **kwargs) -> advantages`` of the chained estimator.
    loss: ``(logp [B,T], batch, *, values=None, entropy=None) -> (loss_sum, denom, metrics)``;
      pure and jittable; differentiate ``loss_sum / denom`` (see ``finalize``). Over
      micro-batches, sum loss_sum and denom separately and divide once.
    prepare: ``batch -> batch`` filling ``batch.aux`` with batch-global quantities (M2PO);
      call it on the whole minibatch before splitting into micro-batches.
    update_transform: optax transform to chain after the optimiser; accepts ``ess_ratio=``.
    default_agg: the aggregation mode.
    uses_kl / needs_ref / needs_values / needs_entropy / needs_grad_norms: what the trainer
      must supply.
    name: preset name or "custom".
    estimator: name of the advantage estimator (its input contract; None if there is none).
  """

  advantages: Callable[..., Any]
  loss: Callable[..., tuple[Array, Array, dict]]
  prepare: Callable[[Batch], Batch]
  update_transform: optax.GradientTransformationExtraArgs
  default_agg: str
  uses_kl: bool
  needs_ref: bool
  needs_values: bool
  needs_entropy: bool
  needs_grad_norms: bool
  name: str = "custom"
  estimator: str | None = None


def finalize(loss_sum: Array, denom: Array) -> Array:
  """``loss_sum / denom``; 0.0 when nothing was valid (documented result, never NaN)."""
  return safe_divide(loss_sum, denom)


# ------------------------------------------------------------------ advantage estimators
def grpo(scale: str = "std", eps: float = 1e-6) -> AdvantageEstimator:
  """GRPO group-normalised advantages; ``advantages(rewards [G,N]) -> [G,N]``."""
  check_choice("scale", scale, ("std", "none"))
  return AdvantageEstimator(lambda rewards: adv_lib.grpo_advantages(rewards, scale, eps),
                            "grpo" if scale == "std" else "dr_grpo")


def dr_grpo() -> AdvantageEstimator:
  """Dr.GRPO: ``advantages(rewards [G,N]) -> s - mean_g``."""
  return grpo(scale="none")


def rloo() -> AdvantageEstimator:
  """RLOO leave-one-out: ``advantages(rewards [G,N]) -> [G,N]``."""
  return AdvantageEstimator(adv_lib.rloo_advantages, "rloo")


def reinforce_pp_baseline() -> AdvantageEstimator:
  """REINFORCE++-baseline: ``advantages(rewards [G,N], lengths=None [G,N]) -> [G,N]``."""
  return AdvantageEstimator(
      lambda rewards, lengths=None: adv_lib.reinforce_pp_baseline_advantages(rewards, lengths),
      "reinforce_pp_baseline")


def reinforce_pp(kl_beta: float = 0.01, gamma: float = 1.0) -> AdvantageEstimator:
  """REINFORCE++: ``advantages(rewards [B], *, mask [B,T], kl=None [B,T]) -> [B,T]``.

  ``kl`` is the per-token KL of the old policy against the reference (e.g.
  ``kl_penalty(old_logp, ref_logp, "k1")``), folded into the reward with ``kl_beta``.
  """

  def compute(rewards, *, mask, kl=None):
    return adv_lib.reinforce_pp_advantages(rewards, mask, kl, kl_beta, gamma)

  return AdvantageEstimator(compute, "reinforce_pp", ("ref_logp", "kl") if kl_beta else ())


def mc_grpo(scale: str = "mad", eps: float = 1e-3) -> AdvantageEstimator:
  """MC-GRPO: ``advantages(rewards [G,N+1]) -> (adv [G,N], rows [G,N])`` (pivot dropped)."""
  check_choice("scale", scale, ("mad", "none"))
  return AdvantageEstimator(lambda rewards: adv_lib.mc_grpo_advantages(rewards, scale, eps),
                            "mc_grpo")


def gae(gamma: float = 1.0, lam: float = 1.0, whiten: bool = True) -> AdvantageEstimator:
  """GAE: ``advantages(rewards [B,T], *, values [B,T], mask [B,T]) -> (adv, returns)``."""

  def compute(rewards, *, values, mask):
    return adv_lib.gae_advantages(rewards, values, mask, gamma, lam, whiten)

  return AdvantageEstimator(compute, "gae", ("values",))


def gdpo(weights=None, eps: float = 1e-6) -> AdvantageEstimator:
  """GDPO: ``advantages(rewards [G,N,K]) -> [G,N]``."""
  return AdvantageEstimator(lambda rewards: adv_lib.gdpo_advantages(rewards, weights, eps),
                            "gdpo")


def opob(tis_cap: float | None = None) -> AdvantageEstimator:
  """VCPO off-policy optimal baseline:
  ``advantages(rewards [G,N], *, log_w [G,N], grad_sq_norms [G,N]) -> [G,N]``.

  ``log_w = sequence_log_weights(old_logp, behaviour_logp, mask)`` reshaped to [G,N];
  ``grad_sq_norms`` from ``per_row_grad_sq_norms`` or ``head_grad_sq_norms``.
  """

  def compute(rewards, *, log_w, grad_sq_norms):
    return vcpo_lib.opob_advantages(rewards, log_w, grad_sq_norms, tis_cap)

  return AdvantageEstimator(compute, "opob", ("grad_norms",))


# ------------------------------------------------------------------------ loss stages
def _set_policy(terms: LossTerms, loss: Array, metrics: dict) -> LossTerms:
  return terms._replace(policy=loss, metrics={**terms.metrics, **metrics})


def ppo_clip(eps_low: float = 0.2, eps_high: float = 0.2, dual_clip=None,
             ratio_level: str = "token") -> LossStage:
  """PPO clipped surrogate (clip-higher, dual clip; ``ratio_level="sequence"`` is GSPO).

  Metrics: clip_frac, approx_kl (mean k3 of current vs old), ratio_mean.
  """
  pol.check_eps(eps_low, eps_high)
  check_choice("ratio_level", ratio_level, ("token", "sequence"))
  c = pol.resolve_dual_clip(dual_clip)
  if ratio_level == "sequence" and c is not None:
    raise ValueError("dual_clip is not defined for ratio_level='sequence' (GSPO)")

  def apply(terms, x):
    if ratio_level == "sequence":
      log_ratio = pol.gspo_log_ratio(x.logp, x.old_logp, x.mask)
    else:
      log_ratio = x.logp - x.old_logp
    loss, clipped = pol.ppo_clip_per_token(log_ratio, x.advantages, eps_low, eps_high, c)
    return _set_policy(terms, loss, dict(
        clip_frac=masked_mean(clipped.astype(jnp.float32), x.mask),
        approx_kl=masked_mean(kl_penalty(x.logp, x.old_logp, "k3"), x.mask),
        ratio_mean=masked_mean(clamped_exp(log_ratio), x.mask)))

  return LossStage(apply, "policy")


def gspo_clip(eps_low: float = 3e-4, eps_high: float = 4e-4) -> LossStage:
  """GSPO: sequence-level ratio, clip range from the paper (3e-4, 4e-4)."""
  return ppo_clip(eps_low, eps_high, None, "sequence")


def reinforce(ratio: bool = False) -> LossStage:
  """Policy gradient without clipping: ``-A logp`` or, with ``ratio=True``, ``-A exp(logp - old)``.

  Both have the gradient ``-A grad logp`` when ``logp == old``; the ratio form stays an
  importance-sampled estimator over several updates on the same data.
  """

  def apply(terms, x):
    if ratio:
      r = clamped_exp(x.logp - x.old_logp)
      return _set_policy(terms, -x.advantages * r, dict(ratio_mean=masked_mean(r, x.mask)))
    return _set_policy(terms, -x.advantages * x.logp, {})

  return LossStage(apply, "policy")


def truncated_is(cap: float | None = 2.0, level: str = "token") -> LossStage:
  """Multiply the policy term by ``min(exp(old - mu), cap)`` (token) or its sequence product.

  Metrics: tis_weight_mean, tis_clip_frac (fraction of valid tokens at the cap).
  """
  check_choice("TIS level", level, ("token", "sequence"))
  if cap is not None and not cap > 0:
    raise ValueError(f"TIS cap must be > 0 or None, got {cap!r}")

  def apply(terms, x):
    w = pol.truncated_is_weights(x.old_logp, x.behaviour_logp, x.mask, cap, level)
    metrics = dict(tis_weight_mean=masked_mean(w, x.mask))
    if cap is not None:
      metrics["tis_clip_frac"] = masked_mean((w >= cap).astype(jnp.float32), x.mask)
    return terms._replace(weight=terms.weight * w, metrics={**terms.metrics, **metrics})

  return LossStage(apply, "correction")


def decoupled(cap: float = 5.0, mode: str = "mask") -> LossStage:
  """AReaL decoupled PPO behaviour weight ``exp(prox - mu)`` (prox = ``batch.old_logp``).

  Tokens with weight above ``cap`` are dropped from the numerator but still counted in the
  denominator (``mode="mask"``), or the weight is clamped (``mode="clamp"``).
  """
  check_choice("decoupled mode", mode, ("mask", "clamp"))
  if not cap > 0:
    raise ValueError(f"decoupled cap must be > 0, got {cap!r}")

  def apply(terms, x):
    w, keep = pol.decoupled_weights(x.old_logp, x.behaviour_logp, x.mask, cap, mode)
    return terms._replace(weight=terms.weight * w, keep=terms.keep & keep,
                          metrics={**terms.metrics,
                                   "behav_weight_mean": masked_mean(w, x.mask)})

  return LossStage(apply, "correction")


def _m2po_prepare(tau):
  def prepare(batch):
    mu = batch.old_logp if batch.behaviour_logp is None else batch.behaviour_logp
    m = batch.mask.astype(bool)
    delta = jnp.where(m, mu - batch.old_logp, 0.0)
    return {"m2po_keep": pol.m2po_mask(delta, m, tau)}
  return prepare


def m2po(tau: float = 0.04) -> LossStage:
  """M2PO second-moment mask on ``delta = mu - prox``; no epsilon clip needed.

  The mask is global over the minibatch: call ``Objective.prepare`` on the whole minibatch
  before micro-batching (otherwise it is computed on the batch given to ``loss``). Dropped
  tokens leave the numerator; the denominator still counts them.
  """
  if not tau > 0:
    raise ValueError(f"m2po tau must be > 0, got {tau!r}")
  prep = _m2po_prepare(tau)

  def apply(terms, x):
    if "m2po_keep" in x.aux:
      keep = x.aux["m2po_keep"].astype(bool) & x.mask
    else:
      keep = pol.m2po_mask(x.behaviour_logp - x.old_logp, x.mask, tau)
    return terms._replace(keep=terms.keep & keep, metrics={
        **terms.metrics,
        "m2po_masked_frac": 1.0 - safe_divide(jnp.sum(keep), jnp.sum(x.mask))})

  return LossStage(apply, "correction", (), prep)


def m2po_clip_budget(tau: float = 0.04) -> LossStage:
  """M2PO clip-budget variant (a policy stage): ratio ``exp(logp - mu)`` clipped PPO-style to
  ``[e^-b, e^b]`` with b solving ``sum min(delta^2, b^2) = tau n`` over the minibatch."""
  if not tau > 0:
    raise ValueError(f"m2po tau must be > 0, got {tau!r}")

  def prepare(batch):
    mu = batch.old_logp if batch.behaviour_logp is None else batch.behaviour_logp
    m = batch.mask.astype(bool)
    b = pol.m2po_clip_bound(jnp.where(m, mu - batch.old_logp, 0.0), m, tau)
    return {"m2po_bound": jnp.broadcast_to(b, m.shape[:1])}

  def apply(terms, x):
    if "m2po_bound" in x.aux:
      b = x.aux["m2po_bound"][:, None]
    else:
      b = pol.m2po_clip_bound(x.behaviour_logp - x.old_logp, x.mask, tau)
    loss, clipped = pol.ppo_clip_per_token(x.logp - x.behaviour_logp, x.advantages,
                                           1.0 - jnp.exp(-b), jnp.exp(b) - 1.0, None)
    return _set_policy(terms, loss, dict(
        clip_frac=masked_mean(clipped.astype(jnp.float32), x.mask)))

  return LossStage(apply, "policy", (), prepare)


def ace(alpha: float = 1.0) -> LossStage:
  """ACE: scale negative-advantage rows by ``1 + alpha softplus(c_i)``.

  ``c_i = sum_t (old - ref)``: the confidence shift of the policy at the start of the step
  (equal to the current policy on the first update), so the factor is a constant weight.
  """

  def apply(terms, x):
    c = jnp.sum(jnp.where(x.mask, x.old_logp - x.ref_logp, 0.0), axis=1)
    return terms._replace(weight=terms.weight * pol.ace_scale(c, x.advantages, alpha))

  return LossStage(apply, "correction", ("ref_logp",))


def kl_term(beta: float = 0.001, kind: str = "k3") -> LossStage:
  """Add ``beta * kl(logp, ref)`` per token (same aggregation as the policy term). Metric: kl."""
  check_choice("KL kind", kind, KL_KINDS)

  def apply(terms, x):
    kl = kl_penalty(x.logp, x.ref_logp, kind)
    return terms._replace(extra=terms.extra + beta * kl,
                          metrics={**terms.metrics, "kl": masked_mean(kl, x.mask)})

  return LossStage(apply, "term", ("ref_logp", "kl"))


def entropy_bonus(coef: float = 0.001) -> LossStage:
  """Subtract ``coef * entropy`` per token; ``loss(..., entropy=[B,T])`` must be given."""

  def apply(terms, x):
    return terms._replace(extra=terms.extra - coef * x.entropy,
                          metrics={**terms.metrics, "entropy": masked_mean(x.entropy, x.mask)})

  return LossStage(apply, "term", ("entropy",))


def value_loss(coef: float = 0.5, clip: float | None = 0.2) -> LossStage:
  """Add ``coef * 0.5 max((v - R)^2, (clip(v) - R)^2)`` per token. Metrics: vf_loss, vf_clip_frac."""

  def apply(terms, x):
    loss, clipped = pol.value_loss_per_token(x.values, x.old_values, x.returns, clip)
    return terms._replace(extra=terms.extra + coef * loss, metrics={
        **terms.metrics, "vf_loss": masked_mean(loss, x.mask),
        "vf_clip_frac": masked_mean(clipped.astype(jnp.float32), x.mask)})

  return LossStage(apply, "term", ("values", "returns", "old_values"))


def ess_metrics() -> LossStage:
  """VCPO ESS metrics of ``w_i = exp(sum_t m (logp - mu))``: ``vcpo/sum_w``, ``vcpo/sum_w2``,
  ``vcpo/num_seqs`` (add them over micro-batches/devices, then ``ess_ratio_from_sums``) and
  ``vcpo/ess_ratio`` of this call."""

  def apply(terms, x):
    log_w = jax.lax.stop_gradient(
        vcpo_lib.sequence_log_weights(x.logp, x.behaviour_logp, x.mask))
    sw, sw2, n = vcpo_lib.ess_sums(log_w, jnp.any(x.mask, axis=1))
    return terms._replace(metrics={**terms.metrics, "vcpo/sum_w": sw, "vcpo/sum_w2": sw2,
                                   "vcpo/num_seqs": n,
                                   "vcpo/ess_ratio": vcpo_lib.ess_ratio_from_sums(sw, sw2, n)})

  return LossStage(apply, "term")


def aggregation(mode: str = "token-mean", norm: float | None = None) -> Aggregation:
  """Aggregation stage; see ``aggregate_parts`` for the modes."""
  if mode not in AGG_MODES:
    raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {list(AGG_MODES)}")
  if norm is not None and not norm > 0:
    raise ValueError(f"norm must be > 0, got {norm!r}")
  return Aggregation(lambda per_token, mask: aggregate_parts(per_token, mask, mode, norm),
                     mode, norm)


# ------------------------------------------------------------------------------ chain
def _sanitize(x: Array | None, mask: Array) -> Array | None:
  if x is None:
    return None
  return sharding.constrain(jnp.where(mask, x, 0.0), _TOKEN_AXES)


def _check_batch(logp: Array, batch: Batch, values, entropy) -> None:
  if not isinstance(batch, Batch):
    raise ValueError(f"batch must be a losses.Batch, got {type(batch).__name__}")
  check_rank("logp", logp, (2,))
  check_same_shape("logp", logp, mask=batch.mask, old_logp=batch.old_logp,
                   behaviour_logp=batch.behaviour_logp, ref_logp=batch.ref_logp,
                   values=values, returns=batch.returns, old_values=batch.old_values,
                   entropy=entropy)
  pol.broadcast_advantages(batch.advantages, logp.shape)


def _missing(needs, x: LossInputs) -> list[str]:
  return [n for n in needs if n in LossInputs._fields and getattr(x, n) is None]


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
  estimators = [p for p in parts if isinstance(p, AdvantageEstimator)]
  stages = [p for p in parts if isinstance(p, LossStage)]
  aggs = [p for p in parts if isinstance(p, Aggregation)]
  txs = [p for p in parts if isinstance(p, optax.GradientTransformation)]
  other = [p for p in parts if not isinstance(
      p, (AdvantageEstimator, LossStage, Aggregation, optax.GradientTransformation))]
  if other:
    raise ValueError(f"chain() got an unsupported part of type {type(other[0]).__name__}")
  if len(estimators) > 1 or len(aggs) > 1 or len(txs) > 1:
    raise ValueError("chain() takes at most one advantage estimator, aggregation and "
                     "update transform")
  if sum(s.kind == "policy" for s in stages) > 1:
    raise ValueError("chain() takes at most one policy stage (ppo_clip, gspo_clip, reinforce, "
                     "m2po_clip_budget)")
  estimator = estimators[0] if estimators else None
  agg = aggs[0] if aggs else aggregation()
  tx = txs[0] if txs else vcpo_lib.identity_transform()
  if not isinstance(tx, optax.GradientTransformationExtraArgs):
    tx = optax.with_extra_args_support(tx)
  needs = {n for s in stages for n in s.needs} | set(estimator.needs if estimator else ())

  def advantages(rewards, **kwargs):
    if estimator is None:
      raise ValueError("this objective has no advantage estimator; pass one to chain()")
    return estimator.compute(rewards, **kwargs)

  def prepare(batch: Batch) -> Batch:
    aux = dict(batch.aux or {})
    for s in stages:
      if s.prepare is not None:
        aux.update(s.prepare(batch))
    return batch._replace(aux=aux)

  def loss(logp: Array, batch: Batch, *, values: Array | None = None,
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
    missing = sorted({n for s in stages for n in _missing(s.needs, x)})
    if missing:
      raise ValueError(f"this objective needs {missing} (in the Batch or as loss kwargs)")
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
      default_agg=agg.mode, uses_kl="kl" in needs, needs_ref="ref_logp" in needs,
      needs_values="values" in needs, needs_entropy="entropy" in needs,
      needs_grad_norms="grad_norms" in needs, name=name,
      estimator=estimator.name if estimator else None)
