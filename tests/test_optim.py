"""The trainer's optimizer and its skip check: one reduction of the gradients.

``optim.clip_by_global_norm`` must give optax's clipped updates bit for bit, whether it
computes the norm or is handed it; ``steps.finite_update`` hands its norm to the optimizer
and skips on a non-finite one.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from rl_jax import config as config_lib
from rl_jax import config_utils, losses, optim, train
from rl_jax.train import steps
from tests.tiny import QUICKSTART, TINY_MODEL


def _tree(scale: float, seed: int = 0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  return {"w": scale * jax.random.normal(k1, (7, 5)), "b": scale * jax.random.normal(k2, (5,)),
          "layers": {"q": scale * jax.random.normal(k3, (3, 4, 2))}}


def _equal(a, b):
  jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, a),
               jax.tree.map(np.asarray, b))


@pytest.mark.parametrize("scale", [1e-3, 1.0, 50.0])  # norm below, near and above the limit
def test_clip_equals_optax_bit_for_bit(scale):
  grads = _tree(scale)
  want, _ = optax.clip_by_global_norm(1.0).update(grads, optax.EmptyState())
  clip = optim.clip_by_global_norm(1.0)
  got, _ = clip.update(grads, clip.init(grads))
  _equal(want, got)
  given, _ = jax.jit(lambda g: clip.update(g, optax.EmptyState(),
                                          grad_norm=optax.tree.norm(g)))(grads)
  want_jit, _ = jax.jit(lambda g: optax.clip_by_global_norm(1.0).update(
      g, optax.EmptyState()))(grads)
  _equal(want_jit, given)


def _optim_config(grad_clip: float) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(dict(
      schedule="constant", warmup_steps=0, grad_clip=grad_clip, b1=0.9, b2=0.99, eps=1e-8,
      weight_decay=0.01, mu_dtype=None))


@pytest.mark.parametrize("grad_clip", [0.0, 1.0])
def test_trainer_update_equals_optax_adamw_behind_its_clip(grad_clip):
  """Three steps of ``finite_update`` with ``make_optimizer`` against optax's own
  clip + AdamW chain (the computation the shared norm replaces)."""
  params = _tree(1.0, seed=1)
  tx = optim.make_optimizer(_optim_config(grad_clip), 1e-2, 10)
  ref = optax.chain(*([optax.clip_by_global_norm(grad_clip)] if grad_clip else []),
                    optax.adamw(1e-2, b1=0.9, b2=0.99, eps=1e-8, weight_decay=0.01))
  step = jax.jit(lambda p, o, g: steps.finite_update(tx, p, o, g, jnp.float32(0.0))[:2])

  @jax.jit
  def ref_step(p, o, g):
    u, o = ref.update(g, o, p)
    return optax.apply_updates(p, u), o

  p, o, rp, ro = params, tx.init(params), params, ref.init(params)
  for i in range(3):
    g = _tree(3.0, seed=10 + i)
    p, o = step(p, o, g)
    rp, ro = ref_step(rp, ro, g)
  _equal(rp, p)


def test_finite_update_hands_its_norm_to_the_optimizer():
  seen = {}

  def update_fn(updates, state, params=None, *, grad_norm=None, **extra):
    seen["norm"] = grad_norm
    return updates, state

  tx = optax.chain(optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn),
                   optax.sgd(0.1))
  params, grads = _tree(1.0), _tree(2.0)
  steps.finite_update(tx, params, tx.init(params), grads, jnp.float32(1.0))
  assert float(seen["norm"]) == float(optax.tree.norm(grads))
  steps.finite_update(tx, params, tx.init(params), grads, jnp.float32(1.0),
                      grad_norm=jnp.float32(7.0))
  assert float(seen["norm"]) == 7.0


@pytest.mark.parametrize("bad", ["nan", "inf", "overflow", "loss"])
def test_non_finite_norm_or_loss_skips(bad):
  """A NaN or infinite entry, or finite entries whose squares overflow float32 (the clip
  would scale the step to zero), skip the update: params and optimizer state unchanged."""
  params = _tree(1.0)
  tx = optim.make_optimizer(_optim_config(1.0), 1e-2, 10)
  opt_state = tx.init(params)
  grads = _tree(1.0, seed=3)
  value = {"nan": jnp.nan, "inf": jnp.inf, "overflow": 1e30, "loss": 1.0}[bad]
  grads["w"] = grads["w"].at[0, 0].set(value)
  loss = jnp.float32(jnp.nan if bad == "loss" else 0.0)
  new_p, new_o, finite = jax.jit(lambda p, o, g, l: steps.finite_update(tx, p, o, g, l))(
      params, opt_state, grads, loss)
  assert not bool(finite)
  _equal(params, new_p)
  _equal(opt_state, new_o)
  ok_p, _, ok = steps.finite_update(tx, params, opt_state, _tree(1.0, seed=3), jnp.float32(0.0))
  assert bool(ok) and not np.array_equal(np.asarray(ok_p["w"]), np.asarray(params["w"]))


def test_rl_update_lowers_to_one_gradient_norm():
  """The compiled RL update takes one global norm of the gradients (one scalar ``sqrt`` in
  its lowering) and no per-leaf ``isfinite`` pass: the skip check, the clip and the metric
  share it. Before, it lowered to two norms and one ``isfinite`` per gradient leaf."""
  s = train.build_setup(config_utils.load_config(QUICKSTART, list(TINY_MODEL) + [
      "train.compile_cache=", "log.tensorboard=False"]))
  state, layout = train.init_state(s), train.make_layout(s)
  G, M, R = s.train.batch_groups, s.rollout.n, s.rollout.max_new_tokens
  inputs = losses.ObjectiveInputs(
      rewards=jnp.zeros((G, M)), mask=jnp.ones((G, M, R), bool),
      old_logp=jnp.full((G, M, R), -1.0), behaviour_logp=jnp.full((G, M, R), -1.0))
  batch = train.UpdateBatch(jnp.ones((G, s.prompt_len), jnp.int32), jnp.full((G,), 3, jnp.int32),
                            jnp.ones((G, M, R), jnp.int32), inputs,
                            losses.Advantages(jnp.ones((G, M))))
  text = train.make_rl_update(s, layout).lower(
      state.params, state.opt_state, state.value_params, state.value_opt_state, batch).as_text()
  assert len(re.findall(r"stablehlo\.sqrt %\S+ : tensor<f32>", text)) == 1
  leaves = len(jax.tree.leaves(state.params))
  assert text.count("is_finite") < leaves, (text.count("is_finite"), leaves)


def _cosine(t: int, lr: float, warmup: int, length: int) -> float:
  """Linear warm-up from 0, then half a cosine down to 0 at update ``length``
  (Loshchilov & Hutter 2017, SGDR, one cycle)."""
  if t < warmup:
    return lr * t / warmup
  return lr * 0.5 * (1.0 + np.cos(np.pi * (t - warmup) / (length - warmup)))


def test_the_cosine_schedule_decays_over_the_runs_optimizer_updates():
  """An RL step makes ``train.minibatches`` x ``train.epochs`` updates: the cosine reaches 0
  at the run's last update, not after ``train.steps`` updates (which left the rest of the run
  at learning rate 0 when there were several minibatches)."""
  from rl_jax.train import context
  config = config_utils.load_config(QUICKSTART, list(TINY_MODEL) + [
      "optim.schedule=cosine", "optim.warmup_steps=2", "optim.weight_decay=0.0",
      "train.steps=3", "train.minibatches=2", "train.epochs=2", "train.batch_groups=4"])
  assert config_lib.stage_updates(config) == (("RL", 12), ("supervised", config.sft.steps))
  tx = context._optimizers(config, losses.get_objective("dapo")).rl
  params = {"w": jnp.zeros((3,))}
  state, lrs = tx.init(params), []
  for _ in range(12):  # Adam's step on a constant gradient is the learning rate itself
    update, state = tx.update({"w": jnp.ones((3,))}, state, params)
    lrs.append(-float(update["w"][0]))
  want = [_cosine(t, config.optim.lr, 2, 12) for t in range(12)]
  np.testing.assert_allclose(lrs, want, rtol=1e-4, atol=1e-12)
  assert lrs[-1] > 0  # before, updates 3..11 ran at learning rate 0
