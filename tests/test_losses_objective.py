"""The objective contract: ObjectiveInputs -> estimator -> Advantages -> loss_batch -> loss.

Each estimator in record form is checked against its plain formula fed by an independent
(numpy) construction of the formula's inputs; the registry, ``Objective.needs`` and
``loss_batch`` are checked on their own.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import losses

G, M, R = 3, 4, 6


def make_inputs(seed=0, g=G, m=M, r=R, components=2):
  """Random groups with contiguous generated tokens; some rows have a stale (masked) prefix.

  Log-probs are -inf and values NaN past the generated tokens, so an estimator that reads
  padding shows it.
  """
  rng = np.random.default_rng(seed)
  t = np.arange(r)
  gen_len = rng.integers(1, r + 1, size=(g, m))
  gen = t < gen_len[..., None]
  stale = np.where(rng.random((g, m)) < 0.4, rng.integers(0, r, size=(g, m)), 0)
  stale = np.minimum(stale, gen_len - 1)  # the last generated token always trains
  mask = gen & (t >= stale[..., None])
  f = lambda *s: rng.normal(size=s).astype(np.float32)
  old = -np.abs(f(g, m, r))
  pad = lambda x, fill: jnp.asarray(np.where(gen, x, fill), jnp.float32)
  return losses.ObjectiveInputs(
      rewards=jnp.asarray(f(g, m)), mask=jnp.asarray(mask), generated_mask=jnp.asarray(gen),
      reward_components=jnp.asarray(f(g, m, components)),
      lengths=jnp.asarray(mask.sum(-1), jnp.float32),
      old_logp=pad(old, -np.inf), behaviour_logp=pad(old + 0.3 * f(g, m, r), -np.inf),
      ref_logp=pad(old + 0.2 * f(g, m, r), -np.inf), values=pad(f(g, m, r), np.nan),
      grad_sq_norms=jnp.asarray(np.abs(f(g, m)) + 0.1),
      teacher_logp=pad(old + 0.5 * f(g, m, r), -np.inf))


def np_inputs(x):
  return jax.tree.map(np.asarray, x)


def masked_diff(a, b, mask):
  """``a - b`` on ``mask``, 0 elsewhere (the padding holds -inf)."""
  return np.where(mask, np.where(mask, a, 0.0) - np.where(mask, b, 0.0), 0.0)


def adv_of(name, inputs, **knobs):
  obj = losses.get_objective("dapo", advantage=name, **knobs)
  out = jax.jit(obj.advantages_from)(inputs)
  assert isinstance(out, losses.Advantages)
  return out


# ------------------------------------------------------------ estimators vs formulas
def test_group_estimators_match_numpy():
  x = make_inputs(0)
  r = np.asarray(x.rewards, np.float64)
  mean, std = r.mean(1, keepdims=True), r.std(1, ddof=1, keepdims=True)
  out = adv_of("grpo", x)
  chex.assert_shape(out.advantages, (G, M))
  assert out.returns is None and out.keep is None
  chex.assert_trees_all_close(out.advantages, (r - mean) / (std + 1e-6), atol=1e-4)
  chex.assert_trees_all_close(adv_of("grpo", x, adv_eps=0.5).advantages,
                              (r - mean) / (std + 0.5), atol=1e-4)
  chex.assert_trees_all_close(adv_of("dr_grpo", x).advantages, r - mean, atol=1e-5)
  loo = np.stack([[r[g, i] - np.delete(r[g], i).mean() for i in range(M)] for g in range(G)])
  chex.assert_trees_all_close(adv_of("rloo", x).advantages, loo, atol=1e-5)


@functools.partial(jax.jit, static_argnums=3)
def _gae_rows(tok, values, mask, gamma_lam=()):
  """The reference: gae_advantages on the [G*M, R] rows, as one program."""
  return losses.gae_advantages(tok, values.reshape(G * M, R), mask.reshape(G * M, R),
                               *gamma_lam)


def test_gae_estimator_rewards_on_last_generated_token():
  x = make_inputs(1)
  n = np_inputs(x)
  tok = np.zeros((G, M, R), np.float32)
  for g in range(G):
    for i in range(M):
      tok[g, i, np.flatnonzero(n.generated_mask[g, i])[-1]] = n.rewards[g, i]
  ref_adv, ref_ret = _gae_rows(jnp.asarray(tok.reshape(G * M, R)), x.values, x.mask, (0.9, 0.8))
  out = adv_of("gae", x, gamma=0.9, lam=0.8)
  chex.assert_shape([out.advantages, out.returns], (G, M, R))
  chex.assert_trees_all_close(out.advantages, ref_adv.reshape(G, M, R), atol=1e-5)
  chex.assert_trees_all_close(out.returns, ref_ret.reshape(G, M, R), atol=1e-5)
  assert np.isfinite(np.asarray(out.advantages)).all()
  assert float(jnp.abs(out.advantages).sum()) > 0
  # a row whose last generated token is outside the loss mask keeps its reward there (the
  # scan over the loss mask then never sees it), not on the last loss token
  cut = np.asarray(n.mask).copy()
  cut[0, 0, np.flatnonzero(n.generated_mask[0, 0])[-1]] = False
  assert cut[0, 0].any()
  z = x._replace(mask=jnp.asarray(cut))
  ref_adv, _ = _gae_rows(jnp.asarray(tok.reshape(G * M, R)), z.values, z.mask)
  chex.assert_trees_all_close(adv_of("gae", z).advantages, ref_adv.reshape(G, M, R), atol=1e-5)
  # generated_mask None: the reward sits on the last loss token instead
  y = x._replace(generated_mask=None, mask=x.generated_mask)
  ref_adv, _ = _gae_rows(jnp.asarray(tok.reshape(G * M, R)), y.values, y.mask)
  chex.assert_trees_all_close(adv_of("gae", y).advantages, ref_adv.reshape(G, M, R),
                              atol=1e-5)


def test_opob_estimator_uses_sequence_log_weights():
  x = make_inputs(2)
  n = np_inputs(x)
  log_w = masked_diff(n.old_logp, n.behaviour_logp, n.mask).sum(-1)
  opob = jax.jit(losses.opob_advantages, static_argnames="tis_cap")  # not op by op
  ref = opob(x.rewards, jnp.asarray(log_w, jnp.float32), x.grad_sq_norms, tis_cap=8.0)
  out = adv_of("opob", x, opob_tis_cap=8.0)
  chex.assert_shape(out.advantages, (G, M))
  chex.assert_trees_all_close(out.advantages, ref, atol=1e-5)
  # the weights matter: uniform weights would give a different baseline
  uniform = opob(x.rewards, np.zeros((G, M), np.float32), np.ones((G, M), np.float32))
  assert not np.allclose(np.asarray(out.advantages), np.asarray(uniform), atol=1e-3)


def test_reinforce_pp_estimator_folds_k1_kl():
  x = make_inputs(3)
  n = np_inputs(x)
  kl = masked_diff(n.old_logp, n.ref_logp, n.mask).astype(np.float32)
  # the reference as one program, not op by op
  rpp = jax.jit(lambda r, m, kl, beta: losses.reinforce_pp_advantages(
      r.reshape(-1), m.reshape(G * M, R), kl, beta, 0.9), static_argnums=3)
  ref = rpp(x.rewards, x.mask, jnp.asarray(kl.reshape(G * M, R)), 0.3)
  out = adv_of("reinforce_pp", x, adv_kl_beta=0.3, gamma=0.9)
  chex.assert_shape(out.advantages, (G, M, R))
  chex.assert_trees_all_close(out.advantages, ref.reshape(G, M, R), atol=1e-5)
  no_kl = rpp(x.rewards, x.mask, None, 0.0)
  chex.assert_trees_all_close(adv_of("reinforce_pp", x, adv_kl_beta=0.0, gamma=0.9).advantages,
                              no_kl.reshape(G, M, R), atol=1e-5)
  assert not np.allclose(np.asarray(out.advantages), np.asarray(no_kl).reshape(G, M, R))
  # without KL the log-probs are not read
  chex.assert_trees_all_close(
      adv_of("reinforce_pp", x._replace(old_logp=None, ref_logp=None), adv_kl_beta=0.0,
             gamma=0.9).advantages, no_kl.reshape(G, M, R), atol=1e-5)


def test_reinforce_pp_baseline_and_gdpo_estimators():
  x = make_inputs(4)
  n = np_inputs(x)
  lengths = n.mask.sum(-1)
  ref = jax.jit(losses.reinforce_pp_baseline_advantages)(x.rewards, jnp.asarray(lengths))
  chex.assert_trees_all_close(adv_of("reinforce_pp_baseline", x).advantages, ref, atol=1e-5)
  chex.assert_trees_all_close(
      adv_of("reinforce_pp_baseline", x._replace(lengths=None)).advantages, ref, atol=1e-5)
  other = x._replace(lengths=jnp.ones((G, M)))
  assert not np.allclose(np.asarray(adv_of("reinforce_pp_baseline", other).advantages),
                         np.asarray(ref))
  w = (1.0, 0.25)
  chex.assert_trees_all_close(adv_of("gdpo", x, gdpo_weights=w).advantages,
                              jax.jit(losses.gdpo_advantages)(x.reward_components,
                                                              jnp.asarray(w)),
                              atol=1e-5)


def test_mc_grpo_estimator_zeroes_and_drops_the_pivot():
  x = make_inputs(5)._replace(rewards=jnp.array([[1.0, 0.0, 0.0, 2.0], [3.0, 1.0, 2.0, 2.5],
                                                 [0.5, 0.5, 0.5, -1.0]]))
  out = adv_of("mc_grpo", x)
  chex.assert_shape([out.advantages, out.keep], (G, M))
  kept, rows = jax.jit(losses.mc_grpo_advantages)(x.rewards)
  keep = np.asarray(out.keep)
  assert keep.dtype == bool and (keep.sum(1) == M - 1).all()
  for g in range(G):
    np.testing.assert_array_equal(np.flatnonzero(keep[g]), np.asarray(rows[g]))
    chex.assert_trees_all_close(np.asarray(out.advantages)[g][keep[g]], kept[g])
    assert float(np.asarray(out.advantages)[g][~keep[g]][0]) == 0.0
  # the hand case of the plain function: [1, 0, 0] -> surviving rows [1000, 0]
  y = losses.ObjectiveInputs(rewards=jnp.array([[1.0, 0.0, 0.0]]), mask=jnp.ones((1, 3, 1), bool))
  out = jax.jit(losses.mc_grpo().compute)(y)
  chex.assert_trees_all_close(out.advantages[out.keep], jnp.array([1000.0, 0.0]), atol=1e-2)
  assert out.keep.tolist() == [[True, True, False]]


@pytest.mark.parametrize("name", [  # GiGPO (turn fields): tests/test_losses_agentic.py
    n for n in losses.advantage_names()
    if not set(losses.TURN_FIELDS) & losses.get_objective("dapo", advantage=n).estimator_needs])
def test_jitted_estimator_equals_eager_bit_for_bit(name):
  """The trainer runs the estimator as one program (``train.make_advantage_fn``): every
  registered estimator gives the eager call's values exactly, NaN rewards included."""
  x = make_inputs(4, g=5, m=6)
  x = x._replace(rewards=x.rewards.at[1, 2].set(jnp.nan))
  obj = losses.get_objective("dapo", advantage=name)
  eager, jitted = obj.advantages_from(x), jax.jit(obj.advantages_from)(x)
  for a, b in zip(eager, jitted):
    assert (a is None) == (b is None)
    if a is not None:
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_estimator_checks_inputs():
  x = make_inputs(6)
  with pytest.raises(ValueError, match=r"'gae' needs \['values'\]"):
    losses.gae().compute(x._replace(values=None))
  with pytest.raises(ValueError, match=r"'opob' needs \['grad_sq_norms'\]"):
    losses.opob().compute(x._replace(grad_sq_norms=None))
  with pytest.raises(ValueError, match="reward_components"):
    losses.gdpo().compute(x._replace(reward_components=None))
  with pytest.raises(ValueError, match="ObjectiveInputs.values has shape"):
    losses.gae().compute(x._replace(values=jnp.zeros((G, M, R + 1))))
  with pytest.raises(ValueError, match="ObjectiveInputs.mask has shape"):
    losses.grpo().compute(x._replace(mask=jnp.ones((G, M + 1, R), bool)))
  with pytest.raises(ValueError, match="expected losses.ObjectiveInputs"):
    losses.grpo().compute(x.rewards)


# --------------------------------------------------------------- Objective.advantages
def test_objective_advantages_array_and_record_forms():
  x = make_inputs(7)
  obj = losses.get_objective("grpo")
  arr = jax.jit(obj.advantages)(x.rewards)
  chex.assert_shape(arr, (G, M))
  chex.assert_trees_all_close(arr, losses.grpo_advantages(x.rewards))
  rec = jax.jit(obj.advantages)(x)
  assert isinstance(rec, losses.Advantages)
  chex.assert_trees_all_close(rec.advantages, arr)
  ppo = losses.get_objective("ppo")
  tok = jax.jit(ppo.advantages)(x.rewards, mask=x.mask, values=x.values)
  from_record = jax.jit(ppo.advantages_from)(x._replace(generated_mask=None))
  chex.assert_trees_all_close(tok, from_record.advantages)
  with pytest.raises(ValueError, match="unknown ObjectiveInputs field"):
    obj.advantages(x.rewards, value=x.values)
  with pytest.raises(ValueError, match="either an ObjectiveInputs"):
    obj.advantages(x, mask=x.mask)
  with pytest.raises(ValueError, match="no advantage estimator"):
    losses.chain(losses.ppo_clip()).advantages_from(x)


# ------------------------------------------------------------------------- registry
def test_custom_estimator_through_get_objective():
  seen = {}

  def factory(knobs):
    seen.update(knobs)
    scale = knobs["adv_eps"]
    return losses.AdvantageEstimator(
        lambda x: losses.Advantages(scale * (x.rewards - jnp.max(x.rewards, -1, keepdims=True))
                                    * x.lengths),
        "max_centred", ("lengths",))

  losses.register_advantage("test_max_centred", factory, overwrite=True)
  assert "test_max_centred" in losses.ADVANTAGES
  assert "test_max_centred" in losses.advantage_names()
  obj = losses.get_objective("grpo", advantage="test_max_centred", adv_eps=2.0)
  assert seen["adv_eps"] == 2.0 and set(seen) == set(losses.PRESET_KNOBS)
  assert obj.estimator == "max_centred"
  assert obj.needs == {"old_logp", "ref_logp", "lengths"}
  x = make_inputs(8)
  r, n = np.asarray(x.rewards), np.asarray(x.lengths)
  chex.assert_trees_all_close(obj.advantages_from(x).advantages,
                              2.0 * (r - r.max(1, keepdims=True)) * n, atol=1e-5)
  with pytest.raises(ValueError, match="already registered"):
    losses.register_advantage("test_max_centred", factory)
  with pytest.raises(ValueError, match="already registered"):
    losses.register_advantage("grpo", factory)
  losses.register_advantage("test_bad_needs", lambda k: losses.AdvantageEstimator(
      lambda x: losses.Advantages(x.rewards), "bad", ("valuez",)), overwrite=True)
  with pytest.raises(ValueError, match="unknown inputs \\['valuez'\\]"):
    losses.get_objective("grpo", advantage="test_bad_needs")
  losses.register_advantage("test_not_estimator", lambda k: "grpo", overwrite=True)
  with pytest.raises(ValueError, match="must return a losses.AdvantageEstimator"):
    losses.get_objective("grpo", advantage="test_not_estimator")
  with pytest.raises(ValueError, match=r"objective option advantage='nope' must be one of \["):
    losses.get_objective("grpo", advantage="nope")


def test_custom_policy_registry():
  losses.register_policy("test_plain_pg", lambda k: losses.reinforce(ratio=False),
                         overwrite=True)
  assert "test_plain_pg" in losses.POLICIES and "test_plain_pg" in losses.policy_names()
  obj = losses.get_objective("dapo", policy="test_plain_pg")
  ref = losses.chain(losses.reinforce(), losses.aggregation("token-mean"))
  x = make_inputs(9)
  batch = losses.loss_batch(x, losses.Advantages(jnp.ones((G, M))))
  logp = jnp.where(batch.mask, batch.old_logp, 0.0) + 0.1

  @jax.jit
  def both(logp, batch):  # one program, not op by op
    return (losses.finalize(*obj.loss(logp, batch)[:2]),
            losses.finalize(*ref.loss(logp, batch)[:2]))

  chex.assert_trees_all_close(*both(logp, batch))
  losses.register_policy("test_kl_as_policy", lambda k: losses.kl_term(0.1), overwrite=True)
  with pytest.raises(ValueError, match="policy LossStage"):
    losses.get_objective("dapo", policy="test_kl_as_policy")


# ------------------------------------------------------------------- Objective.needs
PRESET_NEEDS = {
    "grpo": {"old_logp", "ref_logp"},
    "dapo": {"old_logp"},
    "dr_grpo": {"old_logp"},
    "gspo": {"old_logp"},
    "vcpo": {"old_logp", "behaviour_logp", "grad_sq_norms"},
    "m2po": {"old_logp", "behaviour_logp"},
    "decoupled_ppo": {"old_logp", "behaviour_logp"},
    "ppo": {"old_logp", "values"},
    "rloo": {"old_logp"},
    "reinforce_pp": {"old_logp", "ref_logp"},
    "reinforce_pp_baseline": {"old_logp", "lengths"},
    "mc_grpo": {"old_logp"},
    "on_policy_distill": {"old_logp", "behaviour_logp", "teacher_logp"},
}


def test_preset_needs():
  assert set(PRESET_NEEDS) == set(losses.PRESETS)
  for name, want in PRESET_NEEDS.items():
    obj = losses.get_objective(name)
    assert obj.needs == frozenset(want), name
    assert obj.needs <= set(losses.INPUT_FIELDS) | {"entropy"}
    assert obj.needs_ref == ("ref_logp" in want)
    assert obj.needs_values == ("values" in want)
    assert obj.needs_grad_norms == ("grad_sq_norms" in want)
    assert not obj.needs_entropy
  knob_cases = [
      (dict(kl_beta=0.0), "grpo", {"old_logp"}),
      (dict(entropy_coef=0.01), "dapo", {"old_logp", "entropy"}),
      (dict(ace_alpha=1.0), "dapo", {"old_logp", "ref_logp"}),
      (dict(tis_level="token"), "dapo", {"old_logp", "behaviour_logp"}),
      (dict(advantage="gdpo"), "dapo", {"old_logp", "reward_components"}),
      (dict(adv_kl_beta=0.0), "reinforce_pp", {"old_logp"}),
      (dict(value_coef=0.5, advantage="gae"), "dapo", {"old_logp", "values"}),
      (dict(policy="m2po_clip_budget"), "dapo", {"old_logp", "behaviour_logp"}),
  ]
  for knobs, preset, want in knob_cases:
    assert losses.get_objective(preset, **knobs).needs == frozenset(want), knobs
  assert losses.get_objective("dapo", entropy_coef=0.01).needs_entropy
  assert losses.get_objective("grpo").uses_kl
  assert losses.get_objective("reinforce_pp").uses_kl
  assert not losses.get_objective("dapo", ace_alpha=1.0).uses_kl


@pytest.mark.parametrize("name", sorted(losses.PRESETS))
def test_needs_are_enough_to_train(name):
  """Only the fields ``needs`` names (plus rewards and mask) are given: the step runs."""
  obj = losses.get_objective(name)
  full = make_inputs(10)
  x = losses.ObjectiveInputs(full.rewards, full.mask, **{
      f: getattr(full, f) for f in obj.needs if f in losses.INPUT_FIELDS})

  @jax.jit
  def step(x):  # one program, not op by op
    adv = obj.advantages_from(x)
    batch = obj.prepare(losses.loss_batch(x, adv))
    logp = jnp.where(batch.mask, batch.old_logp, 0.0) + 0.05
    kw = {}
    if "values" in obj.needs:
      kw["values"] = jnp.where(batch.mask, batch.old_values, 0.0) + 0.1
    if "entropy" in obj.needs:
      kw["entropy"] = jnp.ones_like(logp)
    return losses.finalize(*obj.loss(logp, batch, **kw)[:2])

  loss = step(x)
  assert np.isfinite(float(loss)), name
  for f in obj.needs & {"values", "grad_sq_norms", "reward_components"}:
    with pytest.raises(ValueError, match=f):
      obj.advantages_from(x._replace(**{f: None}))


# ------------------------------------------------------------------------ loss_batch
def test_loss_batch_flattens_and_drops_kept_rows():
  x = make_inputs(11)
  keep = jnp.array([[True, False, True, True], [True, True, True, False],
                    [False, True, True, True]])
  adv = losses.Advantages(jnp.arange(G * M, dtype=jnp.float32).reshape(G, M),
                          returns=jnp.ones((G, M, R)), keep=keep)
  b = jax.jit(losses.loss_batch)(x, adv)
  chex.assert_shape([b.mask, b.old_logp, b.behaviour_logp, b.ref_logp, b.returns,
                     b.old_values], (G * M, R))
  chex.assert_shape(b.advantages, (G * M,))
  assert b.values is None and b.aux is None
  mask = np.asarray(b.mask)
  kept = np.asarray(keep).reshape(-1)
  assert not mask[~kept].any()
  np.testing.assert_array_equal(mask[kept], np.asarray(x.mask).reshape(G * M, R)[kept])
  chex.assert_trees_all_close(b.advantages, jnp.arange(G * M, dtype=jnp.float32))
  # row g*M + i is sample i of group g
  n = np_inputs(x)
  for g, i in [(0, 0), (1, 2), (2, 3)]:
    row = g * M + i
    chex.assert_trees_all_close(np.asarray(b.old_logp)[row], n.old_logp[g, i])
    chex.assert_trees_all_close(np.asarray(b.old_values)[row], n.values[g, i])
    chex.assert_trees_all_close(np.asarray(b.ref_logp)[row], n.ref_logp[g, i])
  # token-level advantages and no keep: the loss mask passes through unchanged
  tok = jnp.asarray(np.random.default_rng(0).normal(size=(G, M, R)), jnp.float32)
  b = losses.loss_batch(x, losses.Advantages(tok))
  chex.assert_shape(b.advantages, (G * M, R))
  np.testing.assert_array_equal(np.asarray(b.mask), np.asarray(x.mask).reshape(G * M, R))
  assert b.returns is None
  with pytest.raises(ValueError, match="old_logp"):
    losses.loss_batch(x._replace(old_logp=None), losses.Advantages(tok))
  with pytest.raises(ValueError, match="Advantages.advantages has shape"):
    losses.loss_batch(x, losses.Advantages(jnp.zeros((G * M,))))


def test_mc_grpo_pivot_does_not_train():
  x = make_inputs(12)
  obj = losses.get_objective("mc_grpo")

  @jax.jit
  def adv_and_grad(x):  # one program, not op by op
    adv = obj.advantages_from(x)
    batch = losses.loss_batch(x, adv)
    logp = jnp.where(batch.mask, batch.old_logp, 0.0) + 0.1
    return adv, jax.grad(lambda lp: losses.finalize(*obj.loss(lp, batch)[:2]))(logp)

  adv, grad = adv_and_grad(x)
  pivot = ~np.asarray(adv.keep).reshape(-1)
  assert pivot.sum() == G
  assert np.all(np.asarray(grad)[pivot] == 0.0)
  assert np.abs(np.asarray(grad)[~pivot]).sum() > 0


# -------------------------------------------------------------- knobs and choices
def test_preset_knob_types_and_defaults():
  assert tuple(losses.PRESET_KNOB_TYPES) == losses.PRESET_KNOBS
  assert tuple(losses.PRESET_KNOB_DEFAULTS) == losses.PRESET_KNOBS
  for k, v in losses.PRESET_KNOB_DEFAULTS.items():
    assert v is None or isinstance(v, losses.PRESET_KNOB_TYPES[k]), k
  for preset in losses.PRESETS.values():
    for k, v in preset.items():
      assert v is None or isinstance(v, losses.PRESET_KNOB_TYPES[k]), k
  assert losses.PRESET_KNOB_TYPES["dual_clip"] is float
  assert losses.PRESET_KNOB_TYPES["gdpo_weights"] is tuple
  assert losses.PRESET_KNOB_TYPES["ess_scaling"] is bool
  with pytest.raises(TypeError):
    losses.PRESET_KNOB_DEFAULTS["eps_low"] = 0.1
  assert losses.get_objective("grpo", gdpo_weights=(1.0, 2.0), advantage="gdpo").estimator == "gdpo"


def test_choice_lists_are_the_accepted_values():
  lp = jnp.zeros((2, 3))
  m = jnp.ones((2, 3), bool)
  f = lambda p, x: x @ p

  @jax.jit
  def accepted(lp, m):  # every accepted value in one program, not op by op
    return ([losses.truncated_is_weights(lp, lp, m, 2.0, level) for level in losses.TIS_LEVELS],
            [losses.decoupled_weights(lp, lp, m, 2.0, mode) for mode in losses.DECOUPLED_MODES],
            [losses.ess_lr_multiplier(0.5, 1.0, rule) for rule in losses.ESS_RULES],
            [losses.per_row_grad_sq_norms(f, jnp.ones(3), jnp.eye(3), method=method,
                                          key=jax.random.key(0), num_probes=64)
             for method in losses.GRAD_NORM_METHODS])

  for out in accepted(lp, m)[-1]:
    chex.assert_shape(out, (3,))
  for bad, call in [("TIS level", lambda: losses.truncated_is_weights(lp, lp, m, 2.0, "row")),
                    ("decoupled mode", lambda: losses.decoupled_weights(lp, lp, m, 2.0, "x")),
                    ("ESS rule", lambda: losses.ess_lr_multiplier(0.5, 1.0, "log")),
                    ("method", lambda: losses.per_row_grad_sq_norms(f, jnp.ones(3), jnp.eye(3),
                                                                    method="scan"))]:
    with pytest.raises(ValueError, match=bad):
      call()
  assert tuple(losses.ADVANTAGES)[:9] == ("grpo", "dr_grpo", "rloo", "reinforce_pp",
                                          "reinforce_pp_baseline", "mc_grpo", "gae", "gdpo",
                                          "opob")
  assert tuple(losses.POLICIES)[:6] == ("ppo_clip", "gspo", "reinforce", "reinforce_ratio",
                                        "m2po_clip_budget", "none")


def test_policy_loss_is_the_chained_clip():
  x = make_inputs(13)
  batch = losses.loss_batch(x, losses.Advantages(losses.grpo_advantages(x.rewards)))
  logp = jnp.where(batch.mask, batch.old_logp, 0.0) + 0.3 * jnp.sin(jnp.arange(R) + 1.0)
  loss, metrics = jax.jit(  # one program, not op by op
      lambda logp, b: losses.policy_loss(logp, b.old_logp, b.advantages, b.mask, 0.2, 0.28,
                                         dual_clip=3.0, agg="seq-mean-token-sum-norm",
                                         agg_norm=8.0))(logp, batch)
  assert set(metrics) == {"clip_frac", "approx_kl", "ratio_mean", "num_tokens"}
  # independent numpy computation of the clipped surrogate and the aggregation
  lp, old = np.where(np.asarray(batch.mask), np.asarray(logp), 0.0), np.asarray(
      jnp.where(batch.mask, batch.old_logp, 0.0))
  a = np.asarray(batch.advantages)[:, None]
  ratio = np.exp(lp - old)
  per = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.28))
  per = np.where(a < 0, np.minimum(per, -3.0 * a), per)
  msk = np.asarray(batch.mask)
  rows = msk.any(1).sum()
  chex.assert_trees_all_close(loss, (per * msk).sum() / 8.0 / rows, atol=1e-5)
  chex.assert_trees_all_close(metrics["num_tokens"], float(msk.sum()))
