"""Training-inference mismatch corrections (masked IS, IcePop, geometric-mean IS, MinPRO):
weights and losses against NumPy written from the formulas, the config route, bad values."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config as base
from rl_jax import config_utils, losses, train
from rl_jax.errors import ConfigError
from rl_jax.train import context

QUICKSTART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "configs", "quickstart.py")

B, T = 6, 7
EPS_LOW, EPS_HIGH = 0.2, 0.28  # the dapo preset's clip range, used for every loss below


def close(a, b, tol=1e-5):
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=tol, atol=tol)


def make_case(seed=0, spread=0.4):
  """Right-padded rows of different lengths (one empty), a sampler that differs from the
  trainer by ``spread`` per token, and a current policy a little away from ``old``."""
  rng = np.random.default_rng(seed)
  lengths = np.array([T, 5, 3, 1, 0, 6])
  mask = np.arange(T)[None, :] < lengths[:, None]
  mask[5, 2] = False  # a hole inside a row (an observation token of a multi-turn sample)
  old = -np.abs(rng.normal(1.0, 0.5, (B, T)))
  mu = old + rng.normal(0.0, spread, (B, T))
  logp = old + rng.normal(0.0, 0.15, (B, T))
  adv = rng.normal(size=B)
  # garbage off the mask: every formula must ignore it
  for a in (old, mu, logp):
    a[~mask] = rng.normal(0.0, 30.0, size=(~mask).sum())
  return logp, old, mu, mask, adv


def batch_of(old, mu, mask, adv):
  f = lambda x: jnp.asarray(x, jnp.float32)
  return losses.LossBatch(mask=jnp.asarray(mask), advantages=f(adv), old_logp=f(old),
                      behaviour_logp=f(mu))


# ----------------------------------------------------------- NumPy, from the formulas
def np_mis(old, mu, mask, low, high, level, mode):
  """MIS factor per token: rho (or 1) where rho is in [low, high], else 0; 0 off the mask."""
  out = np.zeros(mask.shape)
  for i in range(mask.shape[0]):
    seq_rho = math.exp(sum(old[i, t] - mu[i, t] for t in range(mask.shape[1]) if mask[i, t]))
    for t in range(mask.shape[1]):
      if not mask[i, t]:
        continue
      rho = seq_rho if level == "sequence" else math.exp(old[i, t] - mu[i, t])
      inside = (low is None or rho >= low) and (high is None or rho <= high)
      out[i, t] = (rho if mode == "weight" else 1.0) if inside else 0.0
  return out


def np_icepop(old, mu, mask, beta, alpha=None):
  alpha = 1.0 / beta if alpha is None else alpha
  k = np.exp(np.where(mask, old - mu, 0.0))
  return np.where(mask & (k >= alpha) & (k <= beta), k, 0.0)


def np_geo(old, mu, mask, cap=None):
  out = np.zeros(mask.shape)
  for i in range(mask.shape[0]):
    n = mask[i].sum()
    if n == 0:
      continue
    w = math.exp(sum((old[i] - mu[i])[mask[i]]) / n)
    out[i, mask[i]] = w if cap is None else min(w, cap)
  return out


def np_minpro(logp, mu, mask):
  out = np.zeros(mask.shape)
  for i in range(mask.shape[0]):
    smallest = None  # smallest ratio among the valid tokens seen so far
    for t in range(mask.shape[1]):
      if not mask[i, t]:
        continue
      out[i, t] = 1.0 if smallest is None else smallest
      r = math.exp(logp[i, t] - mu[i, t])
      smallest = r if smallest is None else min(smallest, r)
  return out


def np_ppo_token(logp, old, adv):
  """Per-token PPO clip loss (dapo's bounds) and its derivative in logp."""
  a = np.broadcast_to(adv[:, None], logp.shape)
  r = np.exp(logp - old)
  unclipped, clipped = -a * r, -a * np.clip(r, 1 - EPS_LOW, 1 + EPS_HIGH)
  loss = np.maximum(unclipped, clipped)
  grad = np.where(clipped > unclipped, 0.0, -a * r)
  return loss, grad


def np_loss_and_grad(factor, logp, old, adv, mask):
  """token-mean of ``factor * l``: the denominator counts every valid token (dropped ones too)."""
  l, g = np_ppo_token(np.where(mask, logp, 0.0), np.where(mask, old, 0.0), adv)
  n = mask.sum()
  return (factor * l)[mask].sum() / n, np.where(mask, factor * g, 0.0) / n


def jax_loss_and_grad(obj, logp, batch):
  def f(lp):
    s, d, m = obj.loss(lp, batch)
    return s / d, m
  (val, mets), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(jnp.asarray(logp, jnp.float32))
  return float(val), np.asarray(grad), mets


def effective(w, keep=None):
  return np.asarray(w if keep is None else jnp.where(keep, w, 0.0))


# ------------------------------------------------------------------------- hand cases
def test_hand_case():
  old = np.log([[0.5, 0.5, 0.9]])
  mu = np.log([[0.1, 0.4, 0.9]])
  m = np.array([[True, True, False]])
  j = lambda x: jnp.asarray(x, jnp.float32)
  # token ratios 5 and 1.25; sequence ratio 6.25; geometric mean 2.5
  w, keep = losses.masked_is_weights(j(old), j(mu), m, None, 8.0, "sequence")
  close(effective(w, keep), [[6.25, 6.25, 0.0]])
  w, keep = losses.masked_is_weights(j(old), j(mu), m, None, 2.0, "sequence")
  close(effective(w, keep), [[0.0, 0.0, 0.0]])
  w, keep = losses.masked_is_weights(j(old), j(mu), m, None, 2.0, "token", "mask")
  close(effective(w, keep), [[0.0, 1.0, 0.0]])
  w, keep = losses.icepop_weights(j(old), j(mu), m, beta=4.0)
  close(effective(w, keep), [[0.0, 1.25, 0.0]])
  w, keep = losses.icepop_weights(j(old), j(mu), m, beta=5.0)
  close(effective(w, keep), [[5.0, 1.25, 0.0]])
  close(losses.geo_mean_is_weights(j(old), j(mu), m), [[2.5, 2.5, 0.0]])
  close(losses.geo_mean_is_weights(j(old), j(mu), m, cap=2.0), [[2.0, 2.0, 0.0]])
  # MinPRO against the current policy: the first token 1, then the smallest earlier ratio
  logp = np.log([[0.2, 0.3, 0.1, 0.8]])
  mu4 = np.log([[0.4, 0.1, 0.2, 0.8]])  # ratios 0.5, 3, 0.5, 1
  close(losses.minpro_weights(j(logp), j(mu4), np.ones((1, 4), bool)), [[1.0, 0.5, 0.5, 0.5]])
  mu4 = np.log([[0.1, 0.1, 0.2, 0.8]])  # ratios 2, 3, 0.5, 1: a minimum above 1 stays
  close(losses.minpro_weights(j(logp), j(mu4), np.ones((1, 4), bool)), [[1.0, 2.0, 2.0, 0.5]])


# ------------------------------------------------------------- weights against NumPy
@pytest.mark.parametrize("level", losses.MIS_LEVELS)
@pytest.mark.parametrize("mode", losses.MIS_MODES)
@pytest.mark.parametrize("low,high", [(None, 2.0), (0.5, 1.5)])
def test_masked_is_weights_match_numpy(level, mode, low, high):
  _, old, mu, mask, adv = make_case(5, spread=0.5)
  b = batch_of(old, mu, mask, adv)
  w, keep = losses.masked_is_weights(b.old_logp, b.behaviour_logp, b.mask, low, high, level,
                                     mode)
  want = np_mis(old, mu, mask, low, high, level, mode)
  close(effective(w, keep), want)
  assert not np.asarray(keep)[~mask].any()
  valid = mask.any(1) if level == "sequence" else mask
  dropped = ((want == 0) & mask).any(1)[valid] if level == "sequence" else (want == 0)[mask]
  assert 0 < dropped.mean() < 1, "the case should drop some rows/tokens and keep others"


@pytest.mark.parametrize("beta,alpha", [(1.5, None), (2.0, 0.8), (5.0, 0.5)])
def test_icepop_weights_match_numpy(beta, alpha):
  _, old, mu, mask, adv = make_case(2, spread=0.6)
  b = batch_of(old, mu, mask, adv)
  w, keep = losses.icepop_weights(b.old_logp, b.behaviour_logp, b.mask, beta, alpha)
  close(effective(w, keep), np_icepop(old, mu, mask, beta, alpha))


@pytest.mark.parametrize("cap", [None, 1.1])
def test_geo_mean_weights_match_numpy(cap):
  _, old, mu, mask, adv = make_case(3)
  b = batch_of(old, mu, mask, adv)
  close(losses.geo_mean_is_weights(b.old_logp, b.behaviour_logp, b.mask, cap),
        np_geo(old, mu, mask, cap))


def test_minpro_weights_match_numpy():
  logp, old, mu, mask, adv = make_case(4)
  b = batch_of(old, mu, mask, adv)
  close(losses.minpro_weights(jnp.asarray(logp, jnp.float32), b.behaviour_logp, b.mask),
        np_minpro(logp, mu, mask))


# ------------------------------------------------------------ losses against NumPy
STAGE_CASES = [
    ("mis_seq", dict(mis_level="sequence"),
     lambda lp, o, u, m: np_mis(o, u, m, None, 2.0, "sequence", "weight")),
    ("mis_seq_band_mask", dict(mis_level="sequence", mis_low=0.5, mis_high=1.5,
                               mis_mode="mask"),
     lambda lp, o, u, m: np_mis(o, u, m, 0.5, 1.5, "sequence", "mask")),
    ("mis_token", dict(mis_level="token", mis_high=1.5),
     lambda lp, o, u, m: np_mis(o, u, m, None, 1.5, "token", "weight")),
    ("icepop", dict(icepop_beta=1.5), lambda lp, o, u, m: np_icepop(o, u, m, 1.5)),
    ("icepop_alpha", dict(icepop_beta=2.0, icepop_alpha=0.9),
     lambda lp, o, u, m: np_icepop(o, u, m, 2.0, 0.9)),
    ("geo", dict(geo_mean_is=True), lambda lp, o, u, m: np_geo(o, u, m)),
    ("geo_cap", dict(geo_mean_is=True, geo_mean_cap=1.05),
     lambda lp, o, u, m: np_geo(o, u, m, 1.05)),
    ("minpro", dict(minpro=True), lambda lp, o, u, m: np_minpro(lp, u, m)),
    ("icepop_and_minpro", dict(icepop_beta=1.5, minpro=True),
     lambda lp, o, u, m: np_icepop(o, u, m, 1.5) * np_minpro(lp, u, m)),
]


@pytest.mark.parametrize("name,knobs,factor", STAGE_CASES, ids=[c[0] for c in STAGE_CASES])
def test_loss_and_gradient_match_numpy(name, knobs, factor):
  """The objective's value and gradient are token-mean of the NumPy factor times the PPO
  term; the gradient flows only through the policy term (the weights are detached)."""
  logp, old, mu, mask, adv = make_case(5, spread=0.5)
  obj = losses.get_objective("dapo", **knobs)
  assert obj.needs == frozenset({"old_logp", "behaviour_logp"})
  val, grad, mets = jax_loss_and_grad(obj, logp, batch_of(old, mu, mask, adv))
  want_val, want_grad = np_loss_and_grad(factor(logp, old, mu, mask), logp, old, adv, mask)
  close(val, want_val)
  close(grad, want_grad)
  plain = losses.get_objective("dapo")
  assert abs(val - jax_loss_and_grad(plain, logp, batch_of(old, mu, mask, adv))[0]) > 1e-4
  for k, v in mets.items():
    assert np.isfinite(v), (k, v)


def test_metrics():
  logp, old, mu, mask, adv = make_case(5, spread=0.5)
  batch = batch_of(old, mu, mask, adv)
  rows = mask.any(1)

  _, _, m = jax_loss_and_grad(losses.get_objective("dapo", mis_level="sequence"), logp, batch)
  f = np_mis(old, mu, mask, None, 2.0, "sequence", "weight")
  close(m["mis_masked_frac"], ((f == 0) & mask).any(1)[rows].mean())
  close(m["mis_weight_mean"], f[f > 0].mean())
  close(m["masked_frac"], ((f == 0) & mask).sum() / mask.sum())

  _, _, m = jax_loss_and_grad(losses.get_objective("dapo", icepop_beta=1.5), logp, batch)
  f = np_icepop(old, mu, mask, 1.5)
  close(m["icepop_masked_frac"], ((f == 0) & mask).sum() / mask.sum())
  close(m["icepop_weight_mean"], f[f > 0].mean())

  _, _, m = jax_loss_and_grad(
      losses.get_objective("dapo", geo_mean_is=True, geo_mean_cap=1.05), logp, batch)
  f = np_geo(old, mu, mask, 1.05)
  per_row = f.max(1)[rows]
  close(m["geo_mean_weight_mean"], per_row.mean())
  close(m["geo_mean_clip_frac"], np.isclose(per_row, 1.05).mean())

  _, _, m = jax_loss_and_grad(losses.get_objective("dapo", minpro=True), logp, batch)
  close(m["minpro_weight_mean"], np_minpro(logp, mu, mask)[mask].mean())


def test_no_mismatch_changes_nothing():
  """With the sampler equal to the trainer every correction is the identity (MinPRO too, at
  the first update, where logp = old)."""
  _, old, _, mask, adv = make_case(6)
  batch = batch_of(old, old, mask, adv)
  want = jax_loss_and_grad(losses.get_objective("dapo"), old, batch)
  for knobs in (dict(mis_level="sequence"), dict(mis_level="token", mis_mode="mask"),
                dict(icepop_beta=1.01), dict(geo_mean_is=True), dict(minpro=True)):
    got = jax_loss_and_grad(losses.get_objective("dapo", **knobs), old, batch)
    close(got[0], want[0])
    close(got[1], want[1])


def test_stages_compose_with_chain():
  logp, old, mu, mask, adv = make_case(7, spread=0.5)
  obj = losses.chain(losses.ppo_clip(EPS_LOW, EPS_HIGH), losses.icepop(1.5), losses.minpro(),
                     losses.geo_mean_is(), losses.masked_is(None, 2.0, "token"),
                     losses.aggregation("token-mean"))
  factor = (np_icepop(old, mu, mask, 1.5) * np_minpro(logp, mu, mask) * np_geo(old, mu, mask)
            * np_mis(old, mu, mask, None, 2.0, "token", "weight"))
  val, grad, _ = jax_loss_and_grad(obj, logp, batch_of(old, mu, mask, adv))
  want_val, want_grad = np_loss_and_grad(factor, logp, old, adv, mask)
  close(val, want_val)
  close(grad, want_grad)


# ------------------------------------------------------------------- config route
@pytest.mark.parametrize("overrides,name", [
    (["loss.mis_level=sequence", "loss.mis_high=1.5"], "mis_seq"),
    (["loss.icepop_beta=1.5"], "icepop"),
    (["loss.icepop_beta=2.0", "loss.icepop_alpha=0.9"], "icepop_alpha"),
    (["loss.geo_mean_is=true", "loss.geo_mean_cap=1.05"], "geo_cap"),
    (["loss.minpro=true"], "minpro"),
])
def test_knobs_flow_from_the_config_to_the_loss(overrides, name):
  factors = {
      "mis_seq": lambda lp, o, u, m: np_mis(o, u, m, None, 1.5, "sequence", "weight"),
      **{c[0]: c[2] for c in STAGE_CASES}}
  config = config_utils.load_config(QUICKSTART, ["loss.preset=dapo", *overrides])
  base.validate(config)
  obj = context.make_objective(config)
  logp, old, mu, mask, adv = make_case(8, spread=0.5)
  val, _, _ = jax_loss_and_grad(obj, logp, batch_of(old, mu, mask, adv))
  want, _ = np_loss_and_grad(factors[name](logp, old, mu, mask), logp, old, adv, mask)
  close(val, want)


# ------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("override,key", [
    ("loss.mis_level=row", "loss.mis_level"), ("loss.mis_mode=drop", "loss.mis_mode"),
    ("loss.mis_low=-0.1", "loss.mis_low"), ("loss.mis_low=1.0", "loss.mis_low"),
    ("loss.mis_high=0.5", "loss.mis_high"), ("loss.icepop_beta=1.0", "loss.icepop_beta"),
    ("loss.icepop_beta=0.5", "loss.icepop_beta"), ("loss.icepop_alpha=0.0", "loss.icepop_alpha"),
    ("loss.icepop_alpha=1.5", "loss.icepop_alpha"), ("loss.geo_mean_cap=-1.0",
                                                     "loss.geo_mean_cap"),
    ("loss.geo_mean_cap=0.0", "loss.geo_mean_cap"), ("loss.geo_mean_cap=inf",
                                                     "loss.geo_mean_cap"),
])
def test_bad_values_fail_in_one_line(override, key):
  config = config_utils.load_config(QUICKSTART, [override])
  with pytest.raises(ConfigError, match=key) as e:
    base.validate(config)
  assert "\n" not in str(e.value)


def test_bad_value_on_the_command_line(tmp_path, capsys):
  with pytest.raises(SystemExit) as e:
    train.main(["rl_jax.train", f"--config={QUICKSTART}", f"--workdir={tmp_path}",
                "--config.loss.icepop_beta=1.0"])
  assert e.value.code == 2
  err = capsys.readouterr().err
  lines = [l for l in err.strip().splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and "loss.icepop_beta" in lines[0], err
  assert "Traceback" not in err


@pytest.mark.parametrize("make,word", [
    (lambda: losses.masked_is(low=-0.5), "mis_low"), (lambda: losses.masked_is(low=1.0),
                                                      "mis_low"),
    (lambda: losses.masked_is(high=0.9), "mis_high"),
    (lambda: losses.masked_is(level="row"), "MIS level"),
    (lambda: losses.masked_is(mode="drop"), "MIS mode"),
    (lambda: losses.icepop(1.0), "icepop_beta"), (lambda: losses.icepop(0.5), "icepop_beta"),
    (lambda: losses.icepop(5.0, alpha=1.0), "icepop_alpha"),
    (lambda: losses.icepop(5.0, alpha=-0.1), "icepop_alpha"),
    (lambda: losses.geo_mean_is(0.0), "geo_mean_cap"),
    (lambda: losses.geo_mean_is(-2.0), "geo_mean_cap"),
    (lambda: losses.get_objective("dapo", icepop_beta=0.9), "icepop_beta"),
    (lambda: losses.get_objective("dapo", mis_level="sequence", mis_high=0.5), "mis_high"),
])
def test_bad_values_in_the_python_api(make, word):
  with pytest.raises(ValueError, match=word) as e:
    make()
  assert "\n" not in str(e.value)
