"""Loss stages: pure functions ``(LossTerms, LossInputs) -> LossTerms`` combined by ``chain``.

A *policy* stage sets the per-token surrogate ``l``; *correction* stages multiply a detached
weight ``w`` or drop tokens (``keep``); *term* stages add unweighted per-token terms (KL,
entropy, value loss). Corrections are multiplicative and terms additive, so stage order does
not matter. The per-token loss is ``where(keep, w * l, 0) + extra``.

Policy stages are also made by name from the preset knobs through a registry
(``POLICIES``, ``register_policy``). See docs/ALGORITHMS.md, "Policy losses" and "KL and
entropy".

Axis letters: B rows, T tokens.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp

from rl_jax.losses import policy as pol
from rl_jax.losses import vcpo as vcpo_lib
from rl_jax.losses._registry import Registry
from rl_jax.losses._utils import Array, check_choice, clamped_exp, masked_mean, safe_divide
from rl_jax.losses.inputs import LossBatch
from rl_jax.losses.kl import KL_KINDS, kl_penalty

__all__ = ["POLICIES", "LossInputs", "LossStage", "LossTerms", "ace", "decoupled",
           "entropy_bonus", "ess_metrics", "geo_mean_is", "gspo_clip", "icepop", "kl_term",
           "m2po", "m2po_clip_budget", "make_policy", "masked_is", "minpro", "policy_names",
           "ppo_clip", "register_policy", "reinforce", "truncated_is", "value_loss"]


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
  """A loss stage.

  Attributes:
    apply: ``(terms, inputs) -> terms``.
    kind: "policy", "correction" or "term".
    needs: LossInputs fields it reads beyond logp, mask, advantages and old_logp
      (``behaviour_logp``, ``ref_logp``, ``values``, ``returns``, ``old_values``,
      ``entropy``); ``chain`` turns them into ``Objective.needs``.
    prepare: ``(batch) -> aux dict`` of batch-global quantities, or None.
    single_pass: a policy term that is the policy gradient only on the data's own policy
      (no importance ratio against ``old``, e.g. ``-A logp``): an objective with it cannot
      take several passes over a batch (``Objective.single_pass``).
  """

  apply: Callable[[LossTerms, LossInputs], LossTerms]
  kind: str  # "policy", "correction" or "term"
  needs: tuple[str, ...] = ()
  prepare: Callable[[LossBatch], dict] | None = None
  single_pass: bool = False


def _with_metrics(terms: LossTerms, metrics: dict, **changes: Any) -> LossTerms:
  return terms._replace(metrics={**terms.metrics, **metrics}, **changes)


# ------------------------------------------------------------------------ policy terms
def ppo_clip(eps_low: float = 0.2, eps_high: float = 0.2, dual_clip=None,
             ratio_level: str = "token") -> LossStage:
  """PPO clipped surrogate (clip-higher, dual clip; ``ratio_level="sequence"`` is GSPO).

  Metrics: clip_frac, approx_kl (mean k3 of current vs old), ratio_mean.

  References: Schulman et al. 2017 (PPO); Ye et al. 2020 (dual clip); Yu et al. 2025 (DAPO,
  clip-higher); Zheng et al. 2025 (GSPO). docs/ALGORITHMS.md, "Policy losses".
  """
  pol.check_eps(eps_low, eps_high)
  check_choice("ratio_level", ratio_level, pol.RATIO_LEVELS)
  c = pol.resolve_dual_clip(dual_clip)
  if ratio_level == "sequence" and c is not None:
    raise ValueError("dual_clip is not defined for ratio_level='sequence' (GSPO)")

  def apply(terms, x):
    if ratio_level == "sequence":
      log_ratio = pol.gspo_log_ratio(x.logp, x.old_logp, x.mask)
    else:
      log_ratio = x.logp - x.old_logp
    loss, clipped = pol.ppo_clip_per_token(log_ratio, x.advantages, eps_low, eps_high, c)
    return _with_metrics(terms, dict(
        clip_frac=masked_mean(clipped.astype(jnp.float32), x.mask),
        approx_kl=masked_mean(kl_penalty(x.logp, x.old_logp, "k3"), x.mask),
        ratio_mean=masked_mean(clamped_exp(log_ratio), x.mask)), policy=loss)

  return LossStage(apply, "policy")


def gspo_clip(eps_low: float = 3e-4, eps_high: float = 4e-4) -> LossStage:
  """GSPO: sequence-level ratio, clip range from the paper (3e-4, 4e-4).

  References: Zheng et al. 2025, Group Sequence Policy Optimization.
  """
  return ppo_clip(eps_low, eps_high, None, "sequence")


def reinforce(ratio: bool = False) -> LossStage:
  """Policy gradient without clipping: ``-A logp`` or, with ``ratio=True``, ``-A exp(logp - old)``.

  Both have the gradient ``-A grad logp`` when ``logp == old``; the ratio form stays an
  importance-sampled estimator over several updates on the same data (the plain form is
  marked ``single_pass``).

  References: Williams 1992 (REINFORCE). docs/ALGORITHMS.md, "Policy losses".
  """

  def apply(terms, x):
    if ratio:
      r = clamped_exp(x.logp - x.old_logp)
      return _with_metrics(terms, dict(ratio_mean=masked_mean(r, x.mask)),
                           policy=-x.advantages * r)
    return _with_metrics(terms, {}, policy=-x.advantages * x.logp)

  return LossStage(apply, "policy", single_pass=not ratio)


def _mismatch_delta(batch: LossBatch) -> tuple[Array, Array]:
  """``(mu - prox, mask)`` of a whole batch, 0 off the mask (M2PO's statistics)."""
  mu = batch.old_logp if batch.behaviour_logp is None else batch.behaviour_logp
  m = batch.mask.astype(bool)
  return jnp.where(m, mu - batch.old_logp, 0.0), m


def _check_tau(tau: float) -> None:
  if not tau > 0:
    raise ValueError(f"m2po tau must be > 0, got {tau!r}")


def m2po_clip_budget(tau: float = 0.04) -> LossStage:
  """M2PO clip-budget variant (a policy stage): ratio ``exp(logp - mu)`` clipped PPO-style to
  ``[e^-b, e^b]`` with b solving ``sum min(delta^2, b^2) = tau n`` over the minibatch.

  References: Zheng et al. 2025 (M2PO). docs/ALGORITHMS.md, "Policy losses".
  """
  _check_tau(tau)

  def prepare(batch):
    delta, m = _mismatch_delta(batch)
    return {"m2po_bound": jnp.broadcast_to(pol.m2po_clip_bound(delta, m, tau), m.shape[:1])}

  def apply(terms, x):
    if "m2po_bound" in x.aux:
      b = x.aux["m2po_bound"][:, None]
    else:
      b = pol.m2po_clip_bound(x.behaviour_logp - x.old_logp, x.mask, tau)
    loss, clipped = pol.ppo_clip_per_token(x.logp - x.behaviour_logp, x.advantages,
                                           1.0 - jnp.exp(-b), jnp.exp(b) - 1.0, None)
    return _with_metrics(terms, dict(clip_frac=masked_mean(clipped.astype(jnp.float32), x.mask)),
                         policy=loss)

  return LossStage(apply, "policy", ("behaviour_logp",), prepare)


# -------------------------------------------------------------------------- corrections
def truncated_is(cap: float | None = 2.0, level: str = "token") -> LossStage:
  """Multiply the policy term by ``min(exp(old - mu), cap)`` (token) or its sequence product.

  Metrics: tis_weight_mean, tis_clip_frac (fraction of valid tokens at the cap).

  References: Yao et al. 2025 (TIS). docs/ALGORITHMS.md, "Policy losses".
  """
  check_choice("TIS level", level, pol.TIS_LEVELS)
  if cap is not None and not cap > 0:
    raise ValueError(f"TIS cap must be > 0 or None, got {cap!r}")

  def apply(terms, x):
    w = pol.truncated_is_weights(x.old_logp, x.behaviour_logp, x.mask, cap, level)
    metrics = dict(tis_weight_mean=masked_mean(w, x.mask))
    if cap is not None:
      metrics["tis_clip_frac"] = masked_mean((w >= cap).astype(jnp.float32), x.mask)
    return _with_metrics(terms, metrics, weight=terms.weight * w)

  return LossStage(apply, "correction", ("behaviour_logp",))


def _valid_rows(mask: Array) -> Array:
  return jnp.any(mask, axis=1)


def masked_is(low: float | None = None, high: float | None = 2.0, level: str = "sequence",
              mode: str = "weight") -> LossStage:
  """Masked importance sampling: drop rows (or tokens) whose ratio ``exp(old - mu)`` (summed
  over the row for ``level="sequence"``) leaves ``[low, high]``; weight the rest by it (or by
  1 with ``mode="mask"``). Dropped tokens leave the numerator, not the denominator.

  Metrics: mis_masked_frac (fraction of valid rows, or tokens at token level, dropped),
  mis_weight_mean (mean weight over kept tokens).

  References: Liu, Li et al. 2025 (MIS). docs/ALGORITHMS.md, "Off-policy corrections".
  """
  check_choice("MIS level", level, pol.MIS_LEVELS)
  check_choice("MIS mode", mode, pol.MIS_MODES)
  pol.check_mis_band(low, high)

  def apply(terms, x):
    w, keep = pol.masked_is_weights(x.old_logp, x.behaviour_logp, x.mask, low, high, level,
                                    mode)
    if level == "sequence":
      rows = _valid_rows(x.mask)
      dropped = masked_mean((~_valid_rows(keep)).astype(jnp.float32), rows)
    else:
      dropped = 1.0 - safe_divide(jnp.sum(keep), jnp.sum(x.mask))
    return _with_metrics(terms, dict(mis_masked_frac=dropped,
                                     mis_weight_mean=masked_mean(w, keep)),
                         weight=terms.weight * w, keep=terms.keep & keep)

  return LossStage(apply, "correction", ("behaviour_logp",))


def icepop(beta: float = 5.0, alpha: float | None = None) -> LossStage:
  """IcePop: weight each token by ``k = exp(old - mu)`` and drop it when ``k`` leaves
  ``[alpha, beta]`` (``alpha = 1/beta`` unless given). Dropped tokens stay in the denominator.

  Metrics: icepop_masked_frac (fraction of valid tokens dropped), icepop_weight_mean (mean
  ``k`` over kept tokens).

  References: Ling Team 2025 (Ring-1T, IcePop). docs/ALGORITHMS.md, "Off-policy corrections".
  """
  pol.check_icepop_band(beta, alpha)

  def apply(terms, x):
    w, keep = pol.icepop_weights(x.old_logp, x.behaviour_logp, x.mask, beta, alpha)
    return _with_metrics(terms, dict(
        icepop_masked_frac=1.0 - safe_divide(jnp.sum(keep), jnp.sum(x.mask)),
        icepop_weight_mean=masked_mean(w, keep)),
        weight=terms.weight * w, keep=terms.keep & keep)

  return LossStage(apply, "correction", ("behaviour_logp",))


def geo_mean_is(cap: float | None = None) -> LossStage:
  """Multiply every token of a row by ``min(exp(mean_t (old - mu)), cap)``, the geometric
  mean of the row's trainer/sampler ratios (``cap=None``: untruncated).

  Metrics: geo_mean_weight_mean (mean over valid rows), geo_mean_clip_frac (fraction of
  valid rows at the cap; only with a cap).

  References: Zheng et al. 2025 (GSPO's length-normalised ratio); Liu, Li et al. 2025.
  docs/ALGORITHMS.md, "Off-policy corrections".
  """
  if cap is not None and not cap > 0:
    raise ValueError(f"geo_mean_cap must be > 0 or None, got {cap!r}")

  def apply(terms, x):
    w = pol.geo_mean_is_weights(x.old_logp, x.behaviour_logp, x.mask, cap)
    rows = _valid_rows(x.mask)
    w_row = jnp.max(w, axis=1)  # the row's weight (every valid token carries it)
    metrics = dict(geo_mean_weight_mean=masked_mean(w_row, rows))
    if cap is not None:
      metrics["geo_mean_clip_frac"] = masked_mean((w_row >= cap).astype(jnp.float32), rows)
    return _with_metrics(terms, metrics, weight=terms.weight * w)

  return LossStage(apply, "correction", ("behaviour_logp",))


def minpro() -> LossStage:
  """MinPRO: multiply token ``t`` by the smallest ratio ``exp(logp - mu)`` of the valid tokens
  before it in its row (1 for the first), detached: a non-cumulative stand-in for the prefix
  importance ratio between the current policy and the sampler.

  Metric: minpro_weight_mean (over valid tokens).

  References: "A Step Back: Prefix Importance Ratio Stabilizes Policy Optimization", 2026
  (MinPRO). docs/ALGORITHMS.md, "Off-policy corrections".
  """

  def apply(terms, x):
    w = pol.minpro_weights(x.logp, x.behaviour_logp, x.mask)
    return _with_metrics(terms, {"minpro_weight_mean": masked_mean(w, x.mask)},
                         weight=terms.weight * w)

  return LossStage(apply, "correction", ("behaviour_logp",))


def decoupled(cap: float = 5.0, mode: str = "mask") -> LossStage:
  """AReaL decoupled PPO behaviour weight ``exp(prox - mu)`` (prox = ``batch.old_logp``).

  Tokens with weight above ``cap`` are dropped from the numerator but still counted in the
  denominator (``mode="mask"``), or the weight is clamped (``mode="clamp"``).

  References: Fu et al. 2025 (AReaL). docs/ALGORITHMS.md, "Policy losses".
  """
  check_choice("decoupled mode", mode, pol.DECOUPLED_MODES)
  if not cap > 0:
    raise ValueError(f"decoupled cap must be > 0, got {cap!r}")

  def apply(terms, x):
    w, keep = pol.decoupled_weights(x.old_logp, x.behaviour_logp, x.mask, cap, mode)
    return _with_metrics(terms, {"behav_weight_mean": masked_mean(w, x.mask)},
                         weight=terms.weight * w, keep=terms.keep & keep)

  return LossStage(apply, "correction", ("behaviour_logp",))


def m2po(tau: float = 0.04) -> LossStage:
  """M2PO second-moment mask on ``delta = mu - prox``; no epsilon clip needed.

  The mask is global over the minibatch: call ``Objective.prepare`` on the whole minibatch
  before micro-batching (otherwise it is computed on the batch given to ``loss``). Dropped
  tokens leave the numerator; the denominator still counts them.

  References: Zheng et al. 2025 (M2PO). docs/ALGORITHMS.md, "Policy losses".
  """
  _check_tau(tau)

  def prepare(batch):
    delta, m = _mismatch_delta(batch)
    return {"m2po_keep": pol.m2po_mask(delta, m, tau)}

  def apply(terms, x):
    if "m2po_keep" in x.aux:
      keep = x.aux["m2po_keep"].astype(bool) & x.mask
    else:
      keep = pol.m2po_mask(x.behaviour_logp - x.old_logp, x.mask, tau)
    return _with_metrics(
        terms, {"m2po_masked_frac": 1.0 - safe_divide(jnp.sum(keep), jnp.sum(x.mask))},
        keep=terms.keep & keep)

  return LossStage(apply, "correction", ("behaviour_logp",), prepare)


def ace(alpha: float = 1.0) -> LossStage:
  """ACE: scale negative-advantage rows by ``1 + alpha softplus(c_i)``.

  ``c_i = sum_t (old - ref)``: the confidence shift of the policy at the start of the step
  (equal to the current policy on the first update), so the factor is a constant weight.

  References: Xu et al. 2026 (ACE). docs/ALGORITHMS.md, "Policy losses".
  """

  def apply(terms, x):
    c = jnp.sum(jnp.where(x.mask, x.old_logp - x.ref_logp, 0.0), axis=1)
    return terms._replace(weight=terms.weight * pol.ace_scale(c, x.advantages, alpha))

  return LossStage(apply, "correction", ("ref_logp",))


# ------------------------------------------------------------------------------ terms
def kl_term(beta: float = 0.001, kind: str = "k3") -> LossStage:
  """Add ``beta * kl(logp, ref)`` per token (same aggregation as the policy term). Metric: kl.

  References: Schulman 2020 (k1, k2, k3 estimators); Shao et al. 2024 (GRPO's k3 KL loss).
  docs/ALGORITHMS.md, "KL and entropy".
  """
  check_choice("KL kind", kind, KL_KINDS)

  def apply(terms, x):
    kl = kl_penalty(x.logp, x.ref_logp, kind)
    return _with_metrics(terms, {"kl": masked_mean(kl, x.mask)}, extra=terms.extra + beta * kl)

  return LossStage(apply, "term", ("ref_logp",))


def entropy_bonus(coef: float = 0.001) -> LossStage:
  """Subtract ``coef * entropy`` per token; ``loss(..., entropy=[B,T])`` must be given.

  References: Mnih et al. 2016 (A3C). docs/ALGORITHMS.md, "KL and entropy".
  """

  def apply(terms, x):
    return _with_metrics(terms, {"entropy": masked_mean(x.entropy, x.mask)},
                         extra=terms.extra - coef * x.entropy)

  return LossStage(apply, "term", ("entropy",))


def value_loss(coef: float = 0.5, clip: float | None = 0.2) -> LossStage:
  """Add ``coef * 0.5 max((v - R)^2, (clip(v) - R)^2)`` per token. Metrics: vf_loss, vf_clip_frac.

  References: Schulman et al. 2017 (PPO value clipping). docs/ALGORITHMS.md, "Policy losses".
  """

  def apply(terms, x):
    loss, clipped = pol.value_loss_per_token(x.values, x.old_values, x.returns, clip)
    return _with_metrics(terms, {
        "vf_loss": masked_mean(loss, x.mask),
        "vf_clip_frac": masked_mean(clipped.astype(jnp.float32), x.mask)},
        extra=terms.extra + coef * loss)

  return LossStage(apply, "term", ("values", "returns", "old_values"))


def ess_metrics() -> LossStage:
  """VCPO ESS metrics of ``w_i = exp(sum_t m (logp - mu))``: ``vcpo/sum_w``, ``vcpo/sum_w2``,
  ``vcpo/num_seqs`` (add them over micro-batches/devices, then ``ess_ratio_from_sums``) and
  ``vcpo/ess_ratio`` of this call.

  References: Kong 1992 (ESS); VCPO. docs/ALGORITHMS.md, "VCPO".
  """

  def apply(terms, x):
    log_w = jax.lax.stop_gradient(
        vcpo_lib.sequence_log_weights(x.logp, x.behaviour_logp, x.mask))
    sw, sw2, n = vcpo_lib.ess_sums(log_w, jnp.any(x.mask, axis=1))
    return _with_metrics(terms, {"vcpo/sum_w": sw, "vcpo/sum_w2": sw2, "vcpo/num_seqs": n,
                                 "vcpo/ess_ratio": vcpo_lib.ess_ratio_from_sums(sw, sw2, n)})

  return LossStage(apply, "term", ("behaviour_logp",))


# ------------------------------------------------------------------------- registry
def _check_policy(name: str, stage: Any) -> None:
  if stage is not None and not (isinstance(stage, LossStage) and stage.kind == "policy"):
    raise ValueError(f"policy {name!r}: the factory must return a policy LossStage or None, "
                     f"got {stage!r:.80}")


_REGISTRY = Registry("policy", _check_policy)

POLICIES = _REGISTRY.view  # live, read-only view of the registered names


def register_policy(name: str, factory: Callable[[Mapping[str, Any]], LossStage | None], *,
                    overwrite: bool = False) -> None:
  """Make ``get_objective(..., policy=name)`` use ``factory``.

  Args:
    name: the value of the ``policy`` knob that selects it.
    factory: ``(knobs) -> LossStage`` of kind "policy" (or None for no policy term);
      ``knobs`` is the full preset knob dict.
    overwrite: replace an existing entry (otherwise a second registration raises).
  """
  _REGISTRY.register(name, factory, overwrite=overwrite)


def policy_names() -> tuple[str, ...]:
  """The registered policy names, built-ins first."""
  return _REGISTRY.names()


def make_policy(name: str, knobs: Mapping[str, Any]) -> LossStage | None:
  """The policy stage registered as ``name``, built from the full knob dict ``knobs``."""
  return _REGISTRY.make(name, knobs)


for _name, _factory in (
    ("ppo_clip", lambda k: ppo_clip(k["eps_low"], k["eps_high"], k["dual_clip"])),
    ("gspo", lambda k: gspo_clip(k["eps_low"], k["eps_high"])),
    ("reinforce", lambda k: reinforce(ratio=False)),
    ("reinforce_ratio", lambda k: reinforce(ratio=True)),
    ("m2po_clip_budget", lambda k: m2po_clip_budget(k["m2po_tau"] or 0.04)),
    ("none", lambda k: None),
):
  register_policy(_name, _factory)
del _name, _factory
