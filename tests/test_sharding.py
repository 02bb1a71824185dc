"""The same forward pass on 1 device and on 8 fake CPU devices under two rule sets."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from rl_jax import models, sharding

CFG = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, architecture="qwen3",
                         qk_norm=True)


def test_rule_lookup_and_collisions():
  mesh = sharding.make_mesh({"fsdp": 2, "tensor": 4})
  spec = sharding.logical_to_spec(("layers", "embed", "q_heads", "head_dim"), "fsdp_tp", mesh,
                                  (2, 32, 4, 8))
  assert spec == P(None, "fsdp", "tensor", None)
  # kv_heads=2 is not divisible by tensor=4: stays replicated instead of failing.
  spec = sharding.logical_to_spec(("layers", "embed", "kv_heads", "head_dim"), "fsdp_tp", mesh,
                                  (2, 32, 2, 8))
  assert spec == P(None, "fsdp", None, None)
  # A mesh axis is used at most once per array.
  spec = sharding.logical_to_spec(("embed", "embed"), "fsdp", mesh, (8, 8))
  assert spec == P("fsdp", None)
  with pytest.raises(ValueError, match="unknown sharding rule set"):
    sharding.get_rules("zero3")
  with pytest.raises(ValueError, match="needs 16 devices"):
    sharding.make_mesh({"fsdp": 16})
  with pytest.raises(ValueError, match="unknown mesh axes"):
    sharding.make_mesh({"model": 8})


@pytest.mark.parametrize("rules,shape", [("fsdp", {"fsdp": 8}),
                                         ("fsdp_tp", {"fsdp": 4, "tensor": 2}),
                                         ("fsdp_tp", {"data": 2, "fsdp": 2, "tensor": 2})])
def test_forward_8_devices_equals_1(rules, shape):
  assert len(jax.devices()) == 8
  params = models.init_params(CFG, jax.random.key(0), std=0.1)
  tokens = jax.random.randint(jax.random.key(1), (8, 12), 0, CFG.vocab_size)
  ref = jax.jit(models.forward, static_argnums=0)(CFG, params, tokens)

  mesh = sharding.make_mesh(shape)
  shardings = models.param_shardings(CFG, mesh, rules)
  sharded = models.init_sharded(CFG, jax.random.key(0), mesh, rules, std=0.1)
  # Created directly with the rule set's shardings.
  for leaf, want in zip(jax.tree.leaves(sharded), jax.tree.leaves(shardings)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
  tok_sharding = NamedSharding(mesh, sharding.logical_to_spec(("batch", "length"), rules, mesh,
                                                              tokens.shape))

  def fwd(p, t):
    with sharding.use(mesh, rules):
      return models.forward(CFG, p, t)

  out = jax.jit(fwd, in_shardings=(shardings, tok_sharding))(sharded, jax.device_put(tokens, tok_sharding))
  np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5, rtol=1e-5)
  # Parameter shardings are what the table says.
  q = sharded["layers"]["q"].sharding.spec
  assert q == (P(None, "fsdp", "tensor", None) if rules == "fsdp_tp" else P(None, "fsdp", None, None))
  assert out.sharding.spec[0] is not None  # batch stays sharded through the model


def test_gradients_8_devices_equal_1():
  params = models.init_params(CFG, jax.random.key(0), std=0.1)
  tokens = jax.random.randint(jax.random.key(1), (8, 10), 0, CFG.vocab_size)
  loss = lambda p, t: models.sequence_logprobs(CFG, p, t).mean()
  ref = jax.jit(jax.grad(loss))(params, tokens)
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  shardings = models.param_shardings(CFG, mesh, "fsdp_tp")
  p8 = jax.device_put(params, shardings)
  g8 = jax.jit(jax.grad(loss), in_shardings=(shardings, None), out_shardings=shardings)(p8, tokens)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5), g8, ref)
