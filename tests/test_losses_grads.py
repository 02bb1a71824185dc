"""Gradients of every loss against central finite differences (float64) and, for PPO and
GSPO, against an independent closed-form gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import losses

B, T = 4, 3


def _batch(rng, token_adv=False, values=False):
  mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], bool)
  f = lambda: jnp.asarray(rng.normal(size=(B, T)))
  old = -jnp.abs(f())
  fields = dict(mask=jnp.asarray(mask), advantages=f() if token_adv else jnp.asarray(
      rng.normal(size=B)), old_logp=old, behaviour_logp=old + 0.2 * f(),
      ref_logp=old + 0.2 * f())
  if values:
    fields.update(values=f(), returns=f(), old_values=f())
  return old + 0.05 * f(), losses.LossBatch(**fields)


def _fd_check(fn, x, rng, n_dirs=3, h=1e-6):
  g = jax.grad(fn)(x)
  for _ in range(n_dirs):
    v = jnp.asarray(rng.normal(size=x.shape))
    fd = (fn(x + h * v) - fn(x - h * v)) / (2 * h)
    np.testing.assert_allclose(float(jnp.vdot(g, v)), float(fd), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("name", ["grpo", "dapo", "dr_grpo", "gspo", "vcpo", "m2po",
                                  "decoupled_ppo", "rloo", "reinforce_pp"])
def test_preset_loss_gradients_match_finite_differences(name):
  with jax.enable_x64(True):
    rng = np.random.default_rng(0)
    logp, batch = _batch(rng)
    obj = losses.get_objective(name, ace_alpha=0.5) if name == "grpo" else \
        losses.get_objective(name)
    batch = obj.prepare(batch)
    _fd_check(jax.jit(lambda q: losses.finalize(*obj.loss(q, batch)[:2])), logp, rng)


def test_ppo_value_loss_and_entropy_gradients_match_finite_differences():
  with jax.enable_x64(True):
    rng = np.random.default_rng(1)
    logp, batch = _batch(rng, token_adv=True, values=True)
    obj = losses.get_objective("ppo", entropy_coef=0.01, kl_beta=0.1, kl_kind="k2")
    ent = jnp.asarray(rng.random((B, T)))
    f = jax.jit(lambda q, v, e: losses.finalize(*obj.loss(q, batch, values=v, entropy=e)[:2]))
    _fd_check(lambda q: f(q, batch.values, ent), logp, rng)
    _fd_check(lambda v: f(logp, v, ent), batch.values, rng)
    _fd_check(lambda e: f(logp, batch.values, e), ent, rng)


@pytest.mark.parametrize("kind", list(losses.KL_KINDS))
def test_kl_gradients_match_finite_differences(kind):
  with jax.enable_x64(True):
    rng = np.random.default_rng(2)
    logp, batch = _batch(rng)
    f = jax.jit(lambda q: losses.aggregate(losses.kl_penalty(q, batch.ref_logp, kind),
                                           batch.mask))
    _fd_check(f, logp + 0.1, rng)


def test_ppo_gradient_closed_form():
  rng = np.random.default_rng(3)
  logp, batch = _batch(rng, token_adv=True)
  logp = batch.old_logp + jnp.asarray(rng.normal(size=(B, T)), jnp.float32) * 0.3
  a, m, old = batch.advantages, batch.mask, batch.old_logp
  g = jax.grad(lambda q: losses.policy_loss(q, old, a, m, 0.2, 0.28, dual_clip=3.0)[0])(logp)
  r = np.exp(np.asarray(logp - old))
  a = np.asarray(a)
  # d/dlogp of -A r is -A r; zero where a clipped branch (incl. dual clip) is active
  clipped = ((a > 0) & (r > 1.28)) | ((a < 0) & (r < 0.8)) | ((a < 0) & (r > 3.0))
  ref = np.where(np.asarray(m) & ~clipped, -a * r, 0.0) / np.asarray(m).sum()
  np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-5, atol=1e-6)


def test_gspo_gradient_closed_form():
  rng = np.random.default_rng(4)
  logp, batch = _batch(rng)
  a, m, old = batch.advantages, np.asarray(batch.mask), batch.old_logp
  g = jax.grad(lambda q: losses.policy_loss(q, old, a, batch.mask, 0.5, 0.5,
                                            ratio_level="sequence",
                                            agg="seq-mean-token-mean")[0])(logp)
  d = np.where(m, np.asarray(logp - old), 0.0)
  s = np.exp(d.sum(1) / m.sum(1))
  a = np.asarray(a)
  active = ~(((a > 0) & (s > 1.5)) | ((a < 0) & (s < 0.5)))
  # GSPO-token: each token gets -A_i s_i / |y_i|, averaged over rows
  ref = np.where(m, (-a * s * active / m.sum(1))[:, None], 0.0) / B
  np.testing.assert_allclose(np.asarray(g), ref, rtol=1e-5, atol=1e-6)
