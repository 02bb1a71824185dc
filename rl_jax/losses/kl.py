"""KL estimators and entropy. See docs/ALGORITHMS.md, "KL and entropy".

Axis letters: B rows, T tokens, V vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rl_jax.losses._utils import Array, check_choice, check_same_shape

__all__ = ["KL_KINDS", "entropy_from_logits", "kl_penalty", "kl_reward"]

KL_KINDS = ("k1", "k2", "k3", "abs")


def kl_penalty(logp: Array, ref_logp: Array, kind: str = "k3") -> Array:
  """Per-token KL(pi_theta || pi_ref) estimate from sampled-token log-probs.

  With ``d = logp - ref_logp``: k1 = d; abs = |d|; k2 = d^2 / 2;
  k3 (low variance) = ``clip(exp(k) - k - 1, -10, 10)`` with ``k = clip(-d, -20, 20)``.

  Args:
    logp: float [..., T] current-policy log-probs of the sampled tokens.
    ref_logp: float, same shape, reference-policy log-probs.
    kind: "k1", "k2", "k3" or "abs".

  Returns:
    float, same shape (masking is left to the caller).

  References: Schulman 2020, Approximating KL Divergence (k1, k2, k3).
  """
  check_choice("KL kind", kind, KL_KINDS)
  check_same_shape("logp", logp, ref_logp=ref_logp)
  d = logp - ref_logp
  if kind == "k1":
    return d
  if kind == "abs":
    return jnp.abs(d)
  if kind == "k2":
    return 0.5 * d * d
  k = jnp.clip(-d, -20.0, 20.0)
  return jnp.clip(jnp.exp(k) - k - 1.0, -10.0, 10.0)


def kl_reward(token_rewards: Array, logp: Array, ref_logp: Array, mask: Array,
              beta: float = 0.001, kind: str = "k1") -> Array:
  """Fold a KL penalty into token rewards: ``r_t - beta * kl_t`` on valid tokens.

  Args:
    token_rewards: float [B,T].
    logp: float [B,T] log-probs of the policy that sampled (or the old policy).
    ref_logp: float [B,T] reference log-probs.
    mask: bool [B,T].
    beta: KL coefficient.
    kind: KL estimator (k1 is the usual in-reward choice).

  Returns:
    float [B,T] shaped rewards, 0 on invalid tokens.

  References: Ouyang et al. 2022 (InstructGPT, KL in the reward).
  """
  check_same_shape("token_rewards", token_rewards, logp=logp, ref_logp=ref_logp, mask=mask)
  kl = kl_penalty(jnp.where(mask, logp, 0.0), jnp.where(mask, ref_logp, 0.0), kind)
  return jnp.where(mask, token_rewards - beta * kl, 0.0)


def entropy_from_logits(logits: Array, temperature: float = 1.0) -> Array:
  """Entropy of the sampling distribution: ``logsumexp(z) - sum softmax(z) z``, z = logits/temp.

  Args:
    logits: float [..., V].
    temperature: sampling temperature (> 0).

  Returns:
    float [...] entropy per position.

  References: standard; entropy bonus as in Mnih et al. 2016 (A3C).
  """
  if not temperature > 0:
    raise ValueError(f"temperature must be > 0, got {temperature!r}")
  z = logits.astype(jnp.float32) / temperature
  return jax.nn.logsumexp(z, axis=-1) - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
