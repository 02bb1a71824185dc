"""Composed objectives: presets, micro-batching, 8-device sharding, compile counts, errors."""

import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_jax import losses

B, T = 8, 5


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def make_batch(seed=0, token_adv=False, with_values=False, b=B, t=T):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, t + 1, size=b)
  lengths[-1] = 0  # one empty row
  mask = np.arange(t)[None, :] < lengths[:, None]
  f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)
  old = -jnp.abs(f(b, t))
  fields = dict(
      mask=jnp.asarray(mask), advantages=f(b, t) if token_adv else f(b), old_logp=old,
      behaviour_logp=old + 0.3 * f(b, t), ref_logp=old + 0.2 * f(b, t))
  if with_values:
    fields.update(values=f(b, t), returns=f(b, t), old_values=f(b, t))
  logp = old + 0.1 * f(b, t)
  return logp, losses.LossBatch(**fields)


PRESET_CASES = ["grpo", "dapo", "dr_grpo", "gspo", "vcpo", "m2po", "decoupled_ppo", "ppo",
                "rloo", "reinforce_pp"]


def _setup(name, agg=None, seed=0):
  kw = {} if agg is None else dict(agg=agg)
  if name == "dr_grpo":
    kw["agg_norm"] = float(T)  # micro-batches share the same C
  obj = losses.get_objective(name, **kw)
  logp, batch = make_batch(seed, token_adv=name == "ppo", with_values=name == "ppo")
  return obj, logp, jax.jit(obj.prepare)(batch)  # one program, not op by op


def _sum_denom_grad(obj):
  def f(logp, batch):
    s, d, m = obj.loss(logp, batch)
    return s, d, m
  def g(logp, batch):
    return jax.grad(lambda lp: obj.loss(lp, batch)[0])(logp)
  return jax.jit(f), jax.jit(g)


# every objective and every aggregation once in the fast suite (the diagonal); the other
# pairs with -m slow
_OBJECTIVES = ["dapo", "m2po", "vcpo", "ppo"]


@pytest.mark.parametrize("name,agg", [
    pytest.param(name, agg, id=f"{name}-{agg}",
                 marks=() if i == j else pytest.mark.slow)
    for j, agg in enumerate(losses.AGG_MODES) for i, name in enumerate(_OBJECTIVES)])
def test_micro_batched_equals_full_batch(name, agg):
  obj, logp, batch = _setup(name, agg)
  f, g = _sum_denom_grad(obj)
  s, d, m = f(logp, batch)
  full_loss = s / d
  full_grad = g(logp, batch) / d
  parts = []
  for k in range(4):
    sl = lambda x: None if x is None else jax.tree.map(lambda y: y[2 * k:2 * k + 2], x)
    mb = jax.tree.map(lambda y: y[2 * k:2 * k + 2], batch)
    parts.append((f(sl(logp), mb), g(sl(logp), mb)))
  tot_s = sum(p[0][0] for p in parts)
  tot_d = sum(p[0][1] for p in parts)
  close(tot_s / tot_d, full_loss)
  close(jnp.concatenate([p[1] for p in parts]) / tot_d, full_grad)
  if name == "vcpo":
    sums = [sum(p[0][2][k] for p in parts) for k in ("vcpo/sum_w", "vcpo/sum_w2",
                                                     "vcpo/num_seqs")]
    close(losses.ess_ratio_from_sums(*sums), m["vcpo/ess_ratio"])


@pytest.mark.parametrize("name", ["grpo", "gspo", "vcpo", "ppo"])
def test_eight_devices_equal_one(name):
  devices = jax.devices()
  assert len(devices) == 8
  obj, logp, batch = _setup(name)
  mesh = jax.sharding.Mesh(np.asarray(devices), ("data",))
  row = NamedSharding(mesh, P("data"))
  shard = lambda x: row if x is not None else None
  fn = lambda lp, b: (obj.loss(lp, b)[:2], jax.grad(lambda q: losses.finalize(*obj.loss(q, b)[:2]))(lp))
  (s1, d1), g1 = jax.jit(fn)(logp, batch)
  in_sh = (row, jax.tree.map(shard, batch))
  sharded = jax.jit(fn, in_shardings=in_sh)
  (s8, d8), g8 = sharded(jax.device_put(logp, row), jax.device_put(batch, in_sh[1]))
  assert len(g8.sharding.device_set) == 8
  close(s8 / d8, s1 / d1)
  close(g8, g1)


def test_no_recompile_when_values_change():
  obj = losses.get_objective("dapo")
  step = jax.jit(lambda lp, b: jax.value_and_grad(
      lambda q: losses.finalize(*obj.loss(q, b)[:2]))(lp))
  adv_fn = jax.jit(obj.advantages)
  for seed in range(3):
    logp, batch = make_batch(seed)
    step(logp, batch)
    adv_fn(jnp.asarray(np.random.default_rng(seed).normal(size=(2, 4)), jnp.float32))
  assert step._cache_size() == 1
  assert adv_fn._cache_size() == 1


@settings(max_examples=25, deadline=None)
@given(hnp.arrays(np.float32, (4, 3), elements=st.floats(-2.0, 0.0, width=32)),
       hnp.arrays(np.float32, (4, 3), elements=st.floats(-0.5, 0.5, width=32)),
       hnp.arrays(np.float32, (4,), elements=st.floats(-2.0, 2.0, width=32)))
def test_decoupled_equals_ppo_when_behaviour_is_proximal(old, delta, adv):
  mask = jnp.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], bool)
  a, b, c = _decoupled_ppo_and_plain(jnp.asarray(old + delta), jnp.asarray(old),
                                     jnp.asarray(adv), mask)
  close(a, b)
  close(a, c)


@jax.jit
def _decoupled_ppo_and_plain(logp, old, adv, mask):
  """The decoupled PPO preset's loss with behaviour = proximal = ``old``, the chained PPO
  clip's and ``policy_loss``'s (one program for every example)."""
  batch = losses.LossBatch(mask=mask, advantages=adv, old_logp=old, behaviour_logp=old)
  dec = losses.get_objective("decoupled_ppo")
  ppo = losses.chain(losses.grpo(), losses.ppo_clip(0.2, 0.2), losses.aggregation("token-mean"))
  return (losses.finalize(*dec.loss(logp, batch)[:2]),
          losses.finalize(*ppo.loss(logp, batch)[:2]),
          losses.policy_loss(logp, old, adv, mask)[0])


def test_chain_metrics_and_flags():
  obj = losses.chain(losses.grpo(), losses.ppo_clip(0.2, 0.28), losses.truncated_is(2.0),
                     losses.kl_term(0.01), losses.aggregation("seq-mean-token-mean"))
  assert obj.needs_ref and obj.uses_kl and not obj.needs_values
  logp, batch = make_batch(3)
  _, _, m = obj.loss(logp, batch)
  for k in ("clip_frac", "approx_kl", "kl", "tis_weight_mean", "mismatch_mean", "mismatch_max",
            "masked_frac", "num_tokens", "num_seqs", "loss"):
    assert k in m and np.isfinite(m[k]), k
  gap = np.abs(np.asarray(batch.old_logp - batch.behaviour_logp))[np.asarray(batch.mask)]
  close(m["mismatch_mean"], gap.mean())
  close(m["mismatch_max"], gap.max())
  # an entropy bonus and the value loss come out of the same call
  obj = losses.chain(losses.ppo_clip(), losses.entropy_bonus(0.1), losses.value_loss(0.5))
  logp, batch = make_batch(4, with_values=True)
  ent = jnp.ones_like(logp)
  s, d, m = obj.loss(logp, batch, entropy=ent)
  ref_obj = losses.chain(losses.ppo_clip(), losses.value_loss(0.5))
  s2, d2, _ = ref_obj.loss(logp, batch)
  close(s / d, s2 / d2 - 0.1)


def test_composed_matches_plain_formulas():
  logp, batch = make_batch(5)
  obj = losses.chain(losses.ppo_clip(0.2, 0.28, dual_clip=True), losses.kl_term(0.04, "k3"),
                     losses.aggregation("seq-mean-token-mean"))
  s, d, _ = obj.loss(logp, batch)
  pl, _ = losses.policy_loss(logp, batch.old_logp, batch.advantages, batch.mask, 0.2, 0.28,
                             dual_clip=3.0, agg="seq-mean-token-mean")
  kl = losses.aggregate(losses.kl_penalty(logp, batch.ref_logp, "k3"), batch.mask,
                        "seq-mean-token-mean")
  close(s / d, pl + 0.04 * kl)
  # GSPO preset equals the plain sequence-level policy loss
  gs = losses.get_objective("gspo")
  s, d, _ = gs.loss(logp, batch)
  ref, _ = losses.policy_loss(logp, batch.old_logp, batch.advantages, batch.mask, 3e-4, 4e-4,
                              ratio_level="sequence", agg="seq-mean-token-mean")
  close(s / d, ref)


def test_presets_run_and_config_mapping():
  for name in losses.PRESETS:
    obj = losses.get_objective(name)
    logp, batch = make_batch(1, token_adv=name == "ppo", with_values=name == "ppo")
    # prepare and loss as one program, not op by op
    s, d, m = jax.jit(lambda lp, b: obj.loss(lp, obj.prepare(b)))(logp, batch)
    assert np.isfinite(s / d), name
  obj = losses.get_objective({"name": "dapo", "eps_high": 0.3}, agg="seq-mean-token-mean")
  assert obj.default_agg == "seq-mean-token-mean"


def test_bad_inputs():
  obj = losses.get_objective("grpo")
  logp, batch = make_batch(0)
  with pytest.raises(ValueError, match="needs \\['ref_logp'\\]"):
    obj.loss(logp, batch._replace(ref_logp=None))
  with pytest.raises(ValueError, match="behaviour_logp has shape"):
    obj.loss(logp, batch._replace(behaviour_logp=jnp.zeros((B, T + 1))))
  with pytest.raises(ValueError, match="losses.LossBatch"):
    obj.loss(logp, dict(batch._asdict()))
  with pytest.raises(ValueError, match="unknown objective 'grop'"):
    losses.get_objective("grop")
  with pytest.raises(ValueError, match="unknown objective option"):
    losses.get_objective("dapo", eps_hi=0.3)
  with pytest.raises(ValueError, match="at most one policy stage"):
    losses.chain(losses.ppo_clip(), losses.reinforce())
  with pytest.raises(ValueError, match="entropy"):
    losses.chain(losses.entropy_bonus(0.1)).loss(logp, batch)
  # NaN rewards: defined result (advantage 0), finite loss
  # each computation below as one program, not op by op
  loss = jax.jit(obj.loss)
  grad = jax.jit(jax.grad(lambda q, b: losses.finalize(*obj.loss(q, b)[:2])))
  adv = jax.jit(obj.advantages)(jnp.array([[1.0, jnp.nan, 0.0, 1.0], [0.0, 0.0, 1.0, 1.0]]))
  assert np.isfinite(adv).all() and float(adv[0, 1]) == 0.0
  s, d, _ = loss(logp, batch._replace(advantages=adv.reshape(-1)))
  assert np.isfinite(s / d)
  # all-masked batch: (0, 0) pair and finalize gives 0, gradients are 0 not NaN
  empty = batch._replace(mask=jnp.zeros((B, T), bool))
  s, d, m = loss(logp, empty)
  assert float(d) == 0.0 and float(losses.finalize(s, d)) == 0.0
  g = grad(logp, empty)
  assert np.all(np.asarray(g) == 0.0)
  # -inf log-probs on padding never leak into the loss or the gradient
  bad = jnp.where(batch.mask, logp, -jnp.inf)
  g = grad(bad, batch)
  assert np.isfinite(np.asarray(g)).all()


def test_update_transform_identity_accepts_ess_ratio():
  obj = losses.get_objective("dapo")
  tx = optax.chain(optax.sgd(0.1), obj.update_transform)
  params = {"w": jnp.ones(3)}
  state = tx.init(params)
  upd, _ = tx.update({"w": jnp.ones(3)}, state, params, ess_ratio=jnp.float32(0.25))
  close(upd["w"], -0.1 * jnp.ones(3))
