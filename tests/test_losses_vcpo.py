"""VCPO: ESS, the ESS learning-rate transform, OPOB and per-row gradient norms."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

from rl_jax import losses


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


@jax.jit
def _ess_cases(w):
  """Every call of test_ess_cases, as one program."""
  rho = losses.effective_sample_size(w) / 4
  return (losses.effective_sample_size(jnp.ones(4)), rho, losses.ess_lr_multiplier(rho),
          losses.ess_lr_multiplier(rho, rule="linear"),
          losses.ess_lr_multiplier(0.275, rho_base=0.55), losses.ess_lr_multiplier(2.0))


def test_ess_cases():
  ones, rho, sqrt, linear, based, above = _ess_cases(jnp.array([1.0, 0.0, 0.0, 0.0]))
  close(ones, 4.0)
  close(rho, 0.25)
  close(sqrt, 0.5)
  close(linear, 0.25)
  close(based, np.sqrt(0.5))
  close(above, 1.0)


_ess_ratio = jax.jit(lambda lw: losses.ess_ratio_from_sums(*losses.ess_sums(lw)))


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, (6,), elements=st.floats(-3.0, 3.0, width=32)),
       st.floats(-5.0, 5.0))
def test_ess_ratio_from_sums_is_scale_invariant(log_w, log_c):
  f = _ess_ratio  # one program for every example
  close(f(jnp.asarray(log_w) + log_c), f(jnp.asarray(log_w)), tol=1e-4)
  w = np.exp(log_w.astype(np.float64))
  close(f(jnp.asarray(log_w)), w.sum() ** 2 / (w ** 2).sum() / 6, tol=1e-4)


def test_scale_by_ess_multiplies_final_adam_updates():
  params = {"w": jnp.arange(3.0), "b": jnp.ones(())}
  grads = {"w": jnp.array([0.1, -0.2, 0.3]), "b": jnp.float32(0.5)}
  adam = optax.adamw(1e-2, weight_decay=0.1)
  tx = optax.chain(optax.adamw(1e-2, weight_decay=0.1), losses.scale_by_ess())

  @jax.jit
  def updates(grads, params):  # one program, not op by op
    ref, _ = adam.update(grads, adam.init(params), params)
    out, _ = tx.update(grads, tx.init(params), params, ess_ratio=jnp.float32(0.25))
    # scaling the loss instead would not change Adam's update: that is why it is a transform
    scaled, _ = adam.update(jax.tree.map(lambda g: 0.5 * g, grads), adam.init(params), params)
    return ref, out, scaled

  ref, out, scaled = updates(grads, params)
  jax.tree.map(lambda a, b: close(a, 0.5 * b), out, ref)
  jax.tree.map(lambda a, b: close(a, b, tol=1e-4), scaled, ref)
  with pytest.raises(ValueError, match="ess_ratio"):
    jax.jit(lambda g, p: tx.update(g, tx.init(p), p))(grads, params)  # raises as it traces


def test_vcpo_preset_feeds_ess_transform():
  obj = losses.get_objective("vcpo")
  assert obj.needs_grad_norms
  rng = np.random.default_rng(0)
  mask = jnp.asarray(np.arange(4)[None] < np.array([[4], [2], [3], [1]]))
  old = jnp.asarray(-np.abs(rng.normal(size=(4, 4))), jnp.float32)
  mu = old + jnp.asarray(rng.normal(size=(4, 4)) * 0.3, jnp.float32)
  batch = losses.LossBatch(mask=mask, advantages=jnp.asarray(rng.normal(size=4), jnp.float32),
                       old_logp=old, behaviour_logp=mu)
  loss, log_weights = jax.jit(obj.loss), jax.jit(losses.sequence_log_weights)  # not op by op
  _, _, m = loss(old, batch)
  w = np.exp(np.asarray(log_weights(old, mu, mask), np.float64))
  close(m["vcpo/ess_ratio"], w.sum() ** 2 / (w ** 2).sum() / 4, tol=1e-4)
  rho = jax.jit(losses.ess_ratio_from_sums)(m["vcpo/sum_w"], m["vcpo/sum_w2"],
                                            m["vcpo/num_seqs"])
  tx = optax.chain(optax.sgd(1.0), obj.update_transform)
  upd, _ = jax.jit(lambda rho: tx.update({"p": jnp.ones(2)}, tx.init({"p": jnp.ones(2)}),
                                         ess_ratio=rho))(rho)
  close(upd["p"], -np.sqrt(min(1.0, float(rho))) * np.ones(2))
  # the loss: -(1/B) sum_i min(w_i, 8) A_i mean_t r_it, r = 1 at logp == old
  tis = np.minimum(np.exp(np.asarray(log_weights(old, mu, mask))), 8.0)
  s, d, _ = loss(old, batch)
  close(s / d, -(tis * np.asarray(batch.advantages)).mean(), tol=1e-4)


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, (2, 4), elements=st.floats(-3.0, 3.0, width=32)),
       st.floats(-2.0, 2.0), st.floats(0.1, 10.0))
def test_opob_equal_weights_is_group_mean(r, log_w, g2):
  f = jax.jit(losses.opob_baseline)
  b = f(jnp.asarray(r), jnp.full((2, 4), log_w, jnp.float32), jnp.full((2, 4), g2, jnp.float32))
  close(b[:, 0], r.mean(1), tol=1e-4)
  adv = jax.jit(losses.opob_advantages)(jnp.asarray(r), jnp.full((2, 4), log_w),
                                        jnp.full((2, 4), g2))
  sd = r.std(1, keepdims=True)
  ref = (r - r.mean(1, keepdims=True)) / np.where(sd <= 1e-8, 1.0, sd)
  close(adv, ref, tol=2e-3)


@jax.jit
def _opob_hand_cases(r, lw):
  """Every opob_baseline call of test_opob_hand_case_and_compat_switch, as one program."""
  return (losses.opob_baseline(r, jnp.zeros((1, 2)), jnp.array([[1.0, 3.0]])),
          losses.opob_baseline(r, lw, jnp.ones((1, 2))),
          losses.opob_baseline(r, lw, jnp.ones((1, 2)), tis_cap=1.5))


def test_opob_hand_case_and_compat_switch():
  r = jnp.array([[0.0, 1.0]])
  lw = jnp.log(jnp.array([[1.0, 2.0]]))
  unweighted, weighted, capped = _opob_hand_cases(r, lw)
  close(unweighted, [[0.75]])
  # W = w^2 g: [1, 4] -> b = 0.8; with compat (cap 1.5): W = w^2 min(w,1.5)^2 g = [1, 9]
  close(weighted, [[0.8]])
  close(capped, [[0.9]])


def _toy_model(key, d=5, h=7, v=6):
  k1, k2, k3 = jax.random.split(key, 3)
  params = dict(emb=jax.random.normal(k1, (v, d)), w1=jax.random.normal(k2, (d, h)) * 0.3,
                head=jax.random.normal(k3, (h, v)) * 0.3)

  def row_logp(p, inp):
    tokens, targets, mask = inp
    hdn = jnp.tanh(p["emb"][tokens] @ p["w1"])
    lp = jax.nn.log_softmax(hdn @ p["head"], axis=-1)
    tok = jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]
    return jnp.sum(jnp.where(mask, tok, 0.0), axis=-1)

  return params, row_logp


def _inputs(key, b=4, t=3, v=6):
  k1, k2 = jax.random.split(key)
  tokens = jax.random.randint(k1, (b, t), 0, v)
  targets = jax.random.randint(k2, (b, t), 0, v)
  mask = jnp.arange(t)[None] < jnp.array([3, 1, 2, 3])[:, None]
  return tokens, targets, mask


def test_per_row_grad_norms_exact_methods_agree_with_loop():
  params, fn = _toy_model(jax.random.key(0))
  inp = _inputs(jax.random.key(1))
  row_grad = jax.jit(jax.grad(lambda p, row: fn(p, row)[0]))
  ref = []
  for i in range(4):
    g = row_grad(params, jax.tree.map(lambda x: x[i:i + 1], inp))
    ref.append(sum(float(jnp.sum(x ** 2)) for x in jax.tree.leaves(g)))
  norms = jax.jit(losses.per_row_grad_sq_norms, static_argnums=0,
                  static_argnames=("method", "chunk_size", "num_probes"))
  close(norms(fn, params, inp, method="vmap"), ref, tol=1e-4)
  close(norms(fn, params, inp, method="map", chunk_size=2), ref, tol=1e-4)
  est = norms(fn, params, inp, method="jvp", num_probes=1000, key=jax.random.key(2))
  # Rademacher estimator: unbiased, relative std <= sqrt(2/K) ~ 4.5%; allow ~4.5 sigma
  np.testing.assert_allclose(np.asarray(est), ref, rtol=0.2)


def test_head_grad_norms_exact_for_the_head():
  params, _ = _toy_model(jax.random.key(3))

  @jax.jit
  def ref_and_out(params, tokens, targets, mask):  # one program, not op by op
    hidden = jnp.tanh(params["emb"][tokens] @ params["w1"])

    def head_logp(w, i):
      lp = jax.nn.log_softmax(hidden[i] @ w / 0.7, axis=-1)
      return jnp.sum(jnp.where(mask[i], jnp.take_along_axis(lp, targets[i][:, None], -1)[:, 0],
                               0.0))

    ref = [jnp.sum(jax.grad(head_logp)(params["head"], i) ** 2) for i in range(4)]
    return ref, losses.head_grad_sq_norms(hidden, hidden @ params["head"], targets, mask, 0.7)

  ref, out = ref_and_out(params, *_inputs(jax.random.key(4)))
  close(out, ref, tol=1e-4)


def test_ess_ratio_stays_scale_invariant_for_small_weights():
  """Sequence log-weights far below 0 (long responses, small per-token drift) keep rho."""
  log_w = jnp.asarray(np.linspace(-0.5, 0.5, 16), jnp.float32)
  rho = lambda lw: float(losses.ess_ratio_from_sums(*losses.ess_sums(lw)))
  w = np.exp(np.linspace(-0.5, 0.5, 16))
  for shift in (0.0, -12.0, -25.0, 20.0):
    close(rho(log_w + shift), w.sum() ** 2 / (w ** 2).sum() / 16, tol=1e-4)
  close(losses.effective_sample_size(jnp.asarray(w * 1e-9, jnp.float32)),
        w.sum() ** 2 / (w ** 2).sum(), tol=1e-3)
