"""Gradient accumulation (``train.micro_batches``): the micro-batched update is the whole
minibatch's update to float rounding, for every kind of objective the trainer feeds, and the
micro-batched forward passes give the same rows; what it rejects; and that it shrinks the
update's activation memory."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config as config_lib
from rl_jax import config_utils, train
from rl_jax.errors import ConfigError
from rl_jax.train import accumulate, memory, steps
from rl_jax.train.layout import jit_on_mesh
from tests.tiny import QUICKSTART, TINY_MODEL, ParityTask

TINY = TINY_MODEL + [
    "sft.steps=0", "train.batch_groups=4", "rollout.n=3", "rollout.max_new_tokens=6",
    "rollout.temperature=1.0", "train.eval_every=0", "log.tensorboard=False",
]
# metrics that are exact under accumulation (the rest are denominator-weighted means)
EXACT = ("loss", "grad_norm", "ess_ratio", "update_skipped", "vcpo/sum_w", "vcpo/sum_w2",
         "vcpo/num_seqs")


def _config(overrides):
  return config_utils.load_config(QUICKSTART, TINY + list(overrides))


def _trainer(overrides):
  s = train.build_setup(_config(overrides))
  s = dataclasses.replace(s, task=ParityTask(s.task))  # rewards with variance in a group
  return s, train.make_trainer(s)


def _copy(tree):
  return jax.tree.map(jnp.copy, tree)


def _updates(overrides, ks=(1, 4)):
  """The same collected batch through each ``train.micro_batches`` in ks: the gradients
  (``accumulate.accumulated`` of ``rl_grads``) and the trainer's compiled update."""
  s, whole = _trainer(overrides)
  state = train.begin_rl(s, train.init_state(s))
  batch, _, _ = train.collect(whole, state)
  carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
  rows = (batch.prompt_tokens, batch.prompt_lengths, batch.tokens, batch.inputs.mask)
  grads, outs, passes = {}, {}, {}
  for k in ks:
    sk, t = (s, whole) if k == 1 else _trainer(overrides + [f"train.micro_batches={k}"])
    fn = jit_on_mesh(accumulate.accumulated(steps.rl_grads(sk), k), t.layout)
    grads[k] = jax.device_get(fn(state.params, state.value_params, batch))
    ref = t.steps.ref_logprobs  # the reference kept in host memory, or LoRA's base pass
    passes[k] = jax.device_get((
        t.steps.logprobs(state.params, *rows),
        t.steps.values(state.value_params, *rows) if "values" in s.objective.needs else None,
        ref(state.params if t.steps.ref_from_policy else state.ref_params, *rows) if ref
        else None))
    outs[k] = jax.device_get(t.steps.rl_update(*_copy(carry), batch))
  for k in ks[1:]:  # the forward passes run in the same micro-batches: the same rows
    for a, b in zip(passes[k], passes[ks[0]]):
      if b is not None:
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
  return jax.device_get(carry), grads, outs, float(s.optim.lr)


def _close_to_leaf_scale(a, b, rel=1e-4):
  """a == b to ``rel`` of each element or of its leaf's largest element (sums with
  cancellation keep the absolute rounding of their terms)."""
  jax.tree.map(lambda x, y: np.testing.assert_allclose(
      x, y, rtol=rel, atol=rel * float(np.max(np.abs(y))) if np.size(y) else 0), a, b)


def _assert_same_update(ref, out, before, lr):
  """``out`` (micro-batched) is ``ref``'s update: every parameter within lr/4 (an Adam step
  moves an element by about lr whatever its gradient, so a gradient of the wrong sign or
  scale is off by ~lr or more; an element whose gradient is at Adam's eps, a rounding
  residue of about 1e-9, moves by a fraction of lr that rounding decides), the optimizer's
  moments and the metrics that accumulate exactly to float rounding."""
  moved = max(float(np.max(np.abs(a - b)))
              for a, b in zip(jax.tree.leaves(ref[0]), jax.tree.leaves(before[0])))
  assert moved > 0.5 * lr, "the update did not move the policy; the comparison would be empty"
  for i in (0, 2):  # policy and critic parameters
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=lr / 4),
                 out[i], ref[i])
  _close_to_leaf_scale(out[1], ref[1])  # Adam's moments: the gradients and their squares
  _close_to_leaf_scale(out[3], ref[3])
  assert out[4].keys() == ref[4].keys()
  for k in EXACT:
    if k in ref[4]:
      np.testing.assert_allclose(out[4][k], ref[4][k], rtol=1e-4, atol=1e-7, err_msg=k)


def _assert_same_grads(ref, out):
  """(loss, denom, metrics, grads, value_grads): loss, denominator and gradients equal to
  float rounding."""
  np.testing.assert_allclose(out[0], ref[0], rtol=1e-5, atol=1e-7)  # loss
  np.testing.assert_allclose(out[1], ref[1], rtol=1e-6)  # the denominators' sum
  _close_to_leaf_scale(out[3], ref[3])
  _close_to_leaf_scale(out[4], ref[4])


@pytest.mark.parametrize("overrides", [
    ["loss.preset=dapo", "loss.entropy_coef=0.01"],         # token-mean, entropy pass
    ["loss.preset=vcpo"],                                   # OPOB, ESS sums scale the update
    ["loss.preset=ppo"],                                    # critic and GAE
    ["loss.preset=grpo", "loss.kl_beta=0.04", "model.lora.rank=4"],  # adapters; base's pass
    # seq-mean with a KL term, the reference's pass from host memory
    ["loss.preset=grpo", "loss.kl_beta=0.04", "train.offload=reference"],
], ids=["dapo-entropy", "vcpo", "ppo", "lora", "grpo-kl-offloaded-reference"])
def test_micro_batched_update_equals_the_whole_minibatch(overrides):
  before, grads, outs, lr = _updates(overrides)
  _assert_same_grads(grads[1], grads[4])  # one group per micro-batch
  _assert_same_update(outs[1], outs[4], before, lr)


def test_micro_batches_on_one_device_equal_the_eight_device_whole_batch():
  """The tests' default mesh shards the 16 groups over 8 devices (2 each; a micro-batch of 8
  groups has one on each device); micro-batches of the sharded batch on 8 devices and of the
  same batch on 1 device give the 8-device whole-batch update."""
  sixteen = ["loss.preset=dapo", "train.batch_groups=16", "rollout.n=2"]
  before, grads8, eight, lr = _updates(sixteen, ks=(1, 2))
  _, grads1, one, _ = _updates(sixteen + ["mesh.num_devices=1"], ks=(2,))
  for grads, out in ((grads8[2], eight[2]), (grads1[2], one[2])):
    _assert_same_grads(grads8[1], grads)
    _assert_same_update(eight[1], out, before, lr)


def test_combine_weights_by_denominators_and_counts_when_they_are_zero():
  def acc(d, g, n=1.0, s=1.0):
    return accumulate.Accumulated(jnp.float32(d), jnp.float32(n), jnp.float32(g),
                                  {"w": jnp.float32(g)}, {}, {"m": jnp.float32(g),
                                                             "vcpo/sum_w": jnp.float32(s)})
  out = accumulate.combine(acc(1.0, 2.0), acc(3.0, 6.0))
  assert float(out.denom) == 4.0 and float(out.count) == 2.0
  np.testing.assert_allclose([out.loss, out.grads["w"], out.metrics["m"]], [5.0] * 3)
  assert float(out.metrics["vcpo/sum_w"]) == 2.0  # a sum over rows: added
  # nothing valid anywhere: a plain mean over the micro-batches, however many
  three = accumulate.combine(accumulate.combine(acc(0, 3.0), acc(0, 6.0)), acc(0, 9.0))
  np.testing.assert_allclose(three.grads["w"], 6.0)
  # an empty start (count 0) takes the first micro-batch as it is
  empty = acc(0.0, 0.0, n=0.0, s=0.0)
  for d in (0.0, 2.5):
    np.testing.assert_allclose(accumulate.combine(empty, acc(d, 7.0)).grads["w"], 7.0)


def test_split_groups_is_strided_over_whole_groups_and_join_undoes_it():
  x = jnp.arange(6 * 2).reshape(6, 2)
  parts = accumulate.split_groups({"x": x, "g": jnp.arange(6)}, 3)
  np.testing.assert_array_equal(parts["g"], [[0, 3], [1, 4], [2, 5]])
  np.testing.assert_array_equal(parts["x"][1], x[jnp.array([1, 4])])
  np.testing.assert_array_equal(accumulate.join_groups(parts["x"]), x)
  with pytest.raises(ValueError, match="6 groups do not split into 4"):
    accumulate.split_groups(x, 4)


@pytest.mark.parametrize("overrides,match", [
    (["train.micro_batches=3"], "train.micro_batches=3 does not divide the 4 groups"),
    (["train.minibatches=2", "train.micro_batches=4"],
     "train.micro_batches=4 does not divide the 2 groups"),
    (["train.micro_batches=0"], "train.micro_batches"),
])
def test_micro_batches_that_do_not_divide_the_minibatch_are_one_error_line(overrides, match):
  with pytest.raises(ConfigError, match=match) as e:
    config_lib.validate(_config(overrides))
  assert "\n" not in str(e.value)


def test_an_objective_with_a_whole_minibatch_statistic_is_refused():
  with pytest.raises(ConfigError, match="M2PO mask") as e:
    train.build_setup(_config(["loss.preset=m2po", "train.micro_batches=2"]))
  assert "\n" not in str(e.value)


def test_micro_batches_shrink_the_updates_temporaries():
  """The compiled update's temporary bytes (activations and their gradients) fall with the
  micro-batch size (XLA's memory analysis of the program the trainer runs)."""
  temps = {}
  for k in (1, 4):
    s, t = _trainer(["loss.preset=dapo", "mesh.num_devices=1", "rollout.max_new_tokens=48", "rollout.n=8",
                     f"train.micro_batches={k}"])
    state = train.begin_rl(s, train.init_state(s))
    # the shapes of a collected batch (``memory.abstract_update_batch``, as the dry run
    # compiles the update): nothing needs sampling
    batch = memory.abstract_update_batch(t, s.geometry.rows)
    carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
    compiled = t.steps.rl_update.lower(*carry, batch).compile()
    temps[k] = compiled.memory_analysis().temp_size_in_bytes
  assert temps[4] < 0.5 * temps[1], temps
