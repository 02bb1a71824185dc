"""VCPO: sequence importance weights, effective sample size (ESS), the ESS learning-rate
multiplier as an optax transform, and the off-policy optimal baseline (OPOB) with
per-trajectory gradient norms.

Axis letters: G groups, M samples per prompt, B rows (= G·M), T tokens, D model width,
V vocabulary; |θ| is the number of parameters.

Per-trajectory gradient norms ``||grad_theta log pi(tau_i)||^2`` (see
``per_row_grad_sq_norms``), cost per minibatch of B rows with P parameters:

  method   exact?      time                           memory
  "vmap"   exact       ~ one batched backward         B x |θ| (all per-row gradients at once)
  "map"    exact       B / chunk batched backwards    chunk x |θ|
  "jvp"    unbiased    n forward-mode passes over     n x |θ| tangents (n = num_probes);
                       the whole batch (relative std ~ sqrt(2/n)); slower than "map" in
                       time at small sizes, it saves memory only
  head     exact for   two T x T Gram matrices per    B x T x T
  (ghost)  the LM head row, no backward               (``head_grad_sq_norms``; a proxy for
                                                       the full-model norm)

Measured numbers: docs/BENCHMARKS.md (scripts/bench_grad_norms.py). On CPU the exact
"map" with a small chunk is the recommended default.

References: VCPO (Variance-Controlled Policy Optimization, mit-han-lab);
Kong 1992 / Owen 2013 for the ESS; Katharopoulos & Fleuret 2018 and Goodfellow 2015 for
last-layer and per-example gradient norms. docs/ALGORITHMS.md, "VCPO".
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from rl_jax.losses._utils import (Array, check_choice, check_rank, check_same_shape,
                                  safe_divide)

__all__ = ["ESS_LOG_W_CLAMP", "ESS_RULES", "GRAD_NORM_METHODS", "effective_sample_size",
           "ess_lr_multiplier", "ess_ratio_from_sums", "ess_sums", "head_grad_sq_norms",
           "identity_transform", "opob_advantages", "opob_baseline", "per_row_grad_sq_norms",
           "scale_by_ess", "sequence_log_weights"]

# log-weights used for ESS sums are clamped so sum(w^2) stays finite in float32.
ESS_LOG_W_CLAMP = 30.0
ESS_RULES = ("sqrt", "linear")                # ess_lr_multiplier / scale_by_ess rules
GRAD_NORM_METHODS = ("vmap", "map", "jvp")    # per_row_grad_sq_norms methods


def sequence_log_weights(logp: Array, behaviour_logp: Array, mask: Array) -> Array:
  """``log w_i = sum_t m (logp - mu)``: [B,T] -> [B] (unclipped, detached by the caller).

  References: VCPO (sequence importance weights). docs/ALGORITHMS.md, "VCPO".
  """
  check_rank("logp", logp, (2,))
  check_same_shape("logp", logp, behaviour_logp=behaviour_logp, mask=mask)
  return jnp.sum(jnp.where(mask, logp - behaviour_logp, 0.0), axis=1)


def ess_sums(log_w: Array, row_valid: Array | None = None) -> tuple[Array, Array, Array]:
  """``(sum w, sum w^2, count)`` over valid rows; additive over micro-batches and devices.

  ``log w`` is clamped to [-30, 30] before exp.

  References: Kong 1992 (ESS); VCPO.
  """
  valid = jnp.ones(log_w.shape, bool) if row_valid is None else row_valid.astype(bool)
  w = jnp.where(valid, jnp.exp(jnp.clip(log_w, -ESS_LOG_W_CLAMP, ESS_LOG_W_CLAMP)), 0.0)
  return jnp.sum(w), jnp.sum(w * w), jnp.sum(valid).astype(w.dtype)


def ess_ratio_from_sums(sum_w: Array, sum_w2: Array, count: Array) -> Array:
  """``rho = ESS / B`` with ``ESS = (sum w)^2 / sum w^2``; 1.0 when B = 0.

  No additive epsilon: rho is invariant to a common scale of the weights over the whole
  clamp range of ``ess_sums`` (an absolute epsilon would drag rho to 0 for small weights).

  References: Kong 1992 (ESS); VCPO (rho = ESS / B).
  """
  ess = safe_divide(sum_w * sum_w, sum_w2)
  return jnp.where(count > 0, safe_divide(ess, count), 1.0)


def effective_sample_size(weights: Array) -> Array:
  """``ESS = (sum w)^2 / sum w^2`` of importance weights [B] (scale invariant; 0 if all 0).

  References: Kong 1992; VCPO.
  """
  check_rank("weights", weights, (1,))
  return safe_divide(jnp.sum(weights) ** 2, jnp.sum(weights ** 2))


def ess_lr_multiplier(ess_ratio: Array, rho_base: float = 1.0, rule: str = "sqrt") -> Array:
  """``sqrt(min(1, rho / rho_base))`` (or the linear rule ``min(1, rho / rho_base)``).

  References: VCPO (ESS learning-rate scaling). docs/ALGORITHMS.md, "VCPO".
  """
  check_choice("ESS rule", rule, ESS_RULES)
  x = jnp.clip(jnp.asarray(ess_ratio, jnp.float32) / rho_base, 0.0, 1.0)
  return jnp.sqrt(x) if rule == "sqrt" else x


def scale_by_ess(rho_base: float = 1.0, rule: str = "sqrt"
                 ) -> optax.GradientTransformationExtraArgs:
  """Optax transform multiplying the final updates by the VCPO ESS learning-rate factor.

  Chain it after the optimiser, ``optax.chain(optax.adamw(lr), scale_by_ess())``, and pass
  the minibatch ESS ratio each step: ``tx.update(grads, state, params, ess_ratio=rho)``
  (``rho = ess_ratio_from_sums(...)`` of the summed ``vcpo/sum_w``, ``vcpo/sum_w2``,
  ``vcpo/num_seqs`` loss metrics). Nothing is carried over steps.

  References: VCPO (ESS learning-rate scaling).
  """
  check_choice("ESS rule", rule, ESS_RULES)
  if not rho_base > 0:
    raise ValueError(f"rho_base must be > 0, got {rho_base!r}")

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params=None, *, ess_ratio=None, **extra_args):
    del params, extra_args
    if ess_ratio is None:
      raise ValueError("scale_by_ess needs the keyword argument ess_ratio=... in update()")
    m = ess_lr_multiplier(ess_ratio, rho_base, rule)
    return jax.tree.map(lambda u: u * m.astype(u.dtype), updates), state

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def identity_transform() -> optax.GradientTransformationExtraArgs:
  """Identity optax transform that accepts (and ignores) extra keyword args such as ess_ratio."""

  def update_fn(updates, state, params=None, **extra_args):
    del params, extra_args
    return updates, state

  return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def opob_baseline(rewards: Array, log_w: Array, grad_sq_norms: Array,
                  tis_cap: float | None = None) -> Array:
  """Off-policy optimal baseline ``b_g = sum_i W_i s_i / (sum_i W_i + 1e-8)``.

  ``W_i = w_i^2 ||grad log pi(tau_i)||^2`` (times ``min(w_i, tis_cap)^2`` when ``tis_cap``
  is set: the released code's compatibility switch).

  Args:
    rewards: float [G,M]; log_w: float [G,M] ``log w_i``; grad_sq_norms: float [G,M].
    tis_cap: None, or the TIS clip (8) for the compatibility weighting.

  Returns:
    float [G,1] baselines (non-finite rewards are left out).

  References: VCPO (off-policy optimal baseline). docs/ALGORITHMS.md, "VCPO".
  """
  check_rank("rewards", rewards, (2,))
  check_same_shape("rewards", rewards, log_w=log_w, grad_sq_norms=grad_sq_norms)
  valid = jnp.isfinite(rewards) & jnp.isfinite(log_w) & jnp.isfinite(grad_sq_norms)
  lw = jnp.where(valid, log_w, 0.0)
  # w^2 in a per-group shifted scale: b_g is invariant to a common factor (up to the 1e-8).
  lw2 = 2.0 * lw
  if tis_cap is not None:
    lw2 = lw2 + 2.0 * jnp.minimum(lw, jnp.log(tis_cap))
  shift = jnp.max(jnp.where(valid, lw2, -jnp.inf), axis=-1, keepdims=True)
  shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
  big_w = jnp.where(valid, jnp.exp(lw2 - shift) * grad_sq_norms, 0.0)
  s = jnp.where(valid, rewards, 0.0)
  return jnp.sum(big_w * s, axis=-1, keepdims=True) / (jnp.sum(big_w, -1, keepdims=True) + 1e-8)


def opob_advantages(rewards: Array, log_w: Array, grad_sq_norms: Array,
                    tis_cap: float | None = None) -> Array:
  """VCPO advantages ``A_i = (s_i - b_g) / sigma_g``, sigma_g the population std (1 if <= 1e-8).

  Args:
    rewards: float [G,M] sequence rewards.
    log_w: float [G,M] ``sum_t m (logp - mu)`` with logp the policy at the start of the step
      (``old``), see ``sequence_log_weights``.
    grad_sq_norms: float [G,M] ``||grad log pi(tau_i)||^2`` (``per_row_grad_sq_norms``).
    tis_cap: compatibility switch (see ``opob_baseline``).

  Returns:
    float [G,M]; 0 for non-finite inputs. With equal ``W_i`` this is mean-centred GRPO with
    population std.

  References: VCPO (off-policy optimal baseline).
  """
  b = opob_baseline(rewards, log_w, grad_sq_norms, tis_cap)
  valid = jnp.isfinite(rewards)
  s = jnp.where(valid, rewards, 0.0)
  n = jnp.sum(valid, axis=-1, keepdims=True).astype(s.dtype)
  mean = safe_divide(jnp.sum(s, -1, keepdims=True), n)
  pvar = safe_divide(jnp.sum(jnp.where(valid, (s - mean) ** 2, 0.0), -1, keepdims=True), n)
  sigma = jnp.sqrt(pvar)
  sigma = jnp.where(sigma <= 1e-8, 1.0, sigma)
  ok = valid & jnp.isfinite(log_w) & jnp.isfinite(grad_sq_norms)
  return jnp.where(ok, (s - b) / sigma, 0.0)


def _tree_sq_norm(tree: Any) -> Array:
  return sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree))


def per_row_grad_sq_norms(row_logp_fn: Callable[[Any, Any], Array], params: Any, inputs: Any,
                          *, method: str = "vmap", chunk_size: int | None = None,
                          num_probes: int = 16, key: Array | None = None) -> Array:
  """Squared gradient norms ``||grad_params f_i||^2`` of each row of ``f = row_logp_fn``.

  Args:
    row_logp_fn: ``(params, inputs) -> [B]`` summed token log-probs per row; rows must be
      independent (row i depends only on ``inputs[i]``).
    params: parameter pytree.
    inputs: pytree of arrays with leading axis B.
    method: "vmap" (exact, all per-row gradients at once), "map" (exact, ``chunk_size``
      rows at a time), or "jvp" (unbiased Rademacher sketch with ``num_probes`` forward-mode
      passes: ``E[(g . v)^2] = ||g||^2``).
    chunk_size: rows per chunk for "map" (default 1); probes evaluated together for "jvp"
      (default all, vectorised).
    num_probes: number of probes for "jvp".
    key: PRNG key for "jvp".

  Returns:
    float32 [B].

  References: VCPO (OPOB needs per-trajectory gradient norms); Hutchinson 1989 (probe
  estimators).
  """
  check_choice("method", method, GRAD_NORM_METHODS)

  def one_row(p, row):
    row = jax.tree.map(lambda x: x[None], row)
    return row_logp_fn(p, row)[0]

  def row_norm(row):
    return _tree_sq_norm(jax.grad(one_row)(params, row))

  if method == "vmap":
    return jax.vmap(row_norm)(inputs)
  if method == "map":
    bs = 1 if chunk_size is None else int(chunk_size)
    if bs < 1:
      raise ValueError(f"chunk_size must be >= 1, got {chunk_size!r}")
    return jax.lax.map(row_norm, inputs, batch_size=bs)
  if key is None:
    raise ValueError("method='jvp' needs a PRNG key")
  if num_probes < 1:
    raise ValueError(f"num_probes must be >= 1, got {num_probes!r}")
  leaves, treedef = jax.tree.flatten(params)

  def probe(k):
    ks = jax.random.split(k, len(leaves))
    v = [jax.random.rademacher(kk, x.shape, x.dtype) for kk, x in zip(ks, leaves)]
    _, dots = jax.jvp(lambda p: row_logp_fn(p, inputs), (params,),
                      (jax.tree.unflatten(treedef, v),))
    return dots.astype(jnp.float32) ** 2

  keys = jax.random.split(key, num_probes)
  bs = num_probes if chunk_size is None else int(chunk_size)
  return jnp.mean(jax.lax.map(probe, keys, batch_size=bs), axis=0)


def head_grad_sq_norms(hidden: Array, logits: Array, targets: Array, mask: Array,
                       temperature: float = 1.0) -> Array:
  """Exact per-row squared gradient norm of ``sum_t log softmax(h_t W / temp)[y_t]`` w.r.t. W.

  For an LM head ``W [D,V]`` the row gradient is ``sum_t h_t (e_{y_t} - p_t)^T / temp``, so
  ``||.||_F^2 = sum_{t,s} m_t m_s (h_t . h_s)((e_{y_t} - p_t) . (e_{y_s} - p_s)) / temp^2``:
  two T x T Gram matrices per row and no backward pass or D x V gradient. Used as a cheap
  proxy for the full-model norm in OPOB (the head is usually the dominant term).

  Args:
    hidden: float [B,T,D] final hidden states feeding the head.
    logits: float [B,T,V] (before temperature).
    targets: int [B,T] sampled tokens.
    mask: bool [B,T].
    temperature: sampling temperature.

  Returns:
    float32 [B].

  References: Goodfellow 2015 (per-example gradient norms); Li et al. 2022 (ghost norm).
  """
  check_rank("hidden", hidden, (3,))
  check_rank("logits", logits, (3,))
  check_same_shape("targets", targets, mask=mask)
  if hidden.shape[:2] != targets.shape or logits.shape[:2] != targets.shape:
    raise ValueError(f"hidden {hidden.shape}, logits {logits.shape} and targets "
                     f"{targets.shape} disagree on [B,T]")
  p = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
  e = jax.nn.one_hot(targets, logits.shape[-1], dtype=jnp.float32)
  m = mask.astype(jnp.float32)[..., None]
  a = (e - p) * m
  h = hidden.astype(jnp.float32) * m
  gram_a = jnp.einsum("btv,bsv->bts", a, a)
  gram_h = jnp.einsum("btd,bsd->bts", h, h)
  return jnp.sum(gram_a * gram_h, axis=(1, 2)) / temperature ** 2
