"""The sampler's own copy of the policy holds its projection matrices in the compute dtype
(``models.cast_projections``, ``Layout.narrowed``): the same tokens, log-probs and expert
records bit for bit as the stored weights, in half the bytes of float32 weights; the memory
plan counts the copy so."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import models, rollout, sharding, train
from rl_jax.train import layout as layout_lib
from rl_jax.train import memory, rollouts, runner
from tests.test_moe_rl import CFG as MOE_CFG
from tests.test_train_async import LAG_ONE, _config

DENSE = models.ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, qkv_bias=True,
                           max_position_embeddings=128)
PROMPTS = [[(7 * i + j) % 30 + 1 for j in range(1 + i % 6)] for i in range(6)]


@pytest.mark.parametrize("cfg", [DENSE, MOE_CFG], ids=["dense", "moe"])
def test_projections_in_the_compute_dtype_sample_the_same_tokens(cfg):
  cfg = cfg.replace(dtype="bfloat16")
  params = models.init_params(cfg, jax.random.key(0), std=0.3)
  cast = models.cast_projections(cfg, params)
  for group in ("layers", "mlp", "moe"):
    for name, x in cast.get(group, {}).items():
      want = jnp.bfloat16 if name in models.transformer.PROJECTIONS else params[group][name].dtype
      assert x.dtype == want, (group, name, x.dtype)
  assert cast["embed"].dtype == jnp.float32
  kw = dict(n=3, max_new_tokens=16, temperature=1.0, seed=3)
  stored, narrowed = (rollout.generate(cfg, p, PROMPTS, **kw) for p in (params, cast))
  np.testing.assert_array_equal(narrowed.tokens, stored.tokens)
  np.testing.assert_array_equal(narrowed.logprobs, stored.logprobs)
  if cfg.is_moe:
    np.testing.assert_array_equal(narrowed.routing, stored.routing)


def test_the_rollout_devices_copy_is_in_the_compute_dtype():
  """The asynchronous trainer's producer on 4 devices of its own, bfloat16 compute: its copy
  of the float32 policy holds bfloat16 projections (norms and embeddings float32) on its
  devices, and the memory plan's ``sampler_copy`` is that copy's bytes."""
  config = _config(LAG_ONE + ["mesh.num_devices=0", "mesh.rollout_devices=4",
                              "model.dtype=bfloat16"])
  s = train.build_setup(config)
  layout = layout_lib.make_layout(s)
  params = models.init_sharded(s.model_cfg, jax.random.key(0), s.mesh, s.rules)
  t = rollouts.TrainParts(setup=s, layout=layout, steps=None, engine=None)
  for copy in (runner.publish(t, params), layout.sampler_params(params)):
    assert copy["layers"]["q"].dtype == jnp.bfloat16
    assert copy["layers"]["attn_norm"].dtype == copy["embed"].dtype == jnp.float32
    assert copy["layers"]["q"].sharding.device_set == set(s.sampler_mesh.devices.flat)
    np.testing.assert_array_equal(np.asarray(copy["layers"]["q"], np.float32),
                                  np.asarray(params["layers"]["q"].astype(jnp.bfloat16),
                                             np.float32))
  copy_bytes = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(copy))
  assert memory._sampler_copy_bytes(s, params) == copy_bytes  # pylint: disable=protected-access
  whole = sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(params))
  assert copy_bytes < 0.75 * whole


def test_one_process_decodes_from_a_copy_with_sampler_copy():
  """``rollout.sampler_copy=True`` on one process (auto is off for CPU programs): the
  sampler's weights are the policy's projections in bfloat16 beside the float32 policy,
  the engine decodes them as they are (``prepare_params`` no longer casts them back to the
  stored dtype), and the memory plan's ``sampler_copy`` is the copy's bytes."""
  from rl_jax.rollout import kv_cache  # pylint: disable=import-outside-toplevel
  from rl_jax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  bf16 = ["model.dtype=bfloat16"]
  assert not layout_lib.make_layout(train.build_setup(_config(bf16))).narrow  # auto on a CPU
  s = train.build_setup(_config(bf16 + ["rollout.sampler_copy=True"]))
  layout = layout_lib.make_layout(s)
  assert layout.narrow and layout.sampler_mesh is layout.mesh
  params = models.init_sharded(s.model_cfg, jax.random.key(0), s.mesh, s.rules)
  copy = layout.sampler_params(params)
  assert copy["layers"]["q"].dtype == copy["layers"]["down"].dtype == jnp.bfloat16
  assert copy["layers"]["attn_norm"].dtype == copy["embed"].dtype == jnp.float32
  for ctx in (None, (s.sampler_mesh, s.rules)):
    held = kv_cache.SamplerParams(s.sampler_cfg, ctx)(copy)
    assert held["layers"]["q"].dtype == jnp.bfloat16 and held["embed"].dtype == jnp.float32
    widened = kv_cache.SamplerParams(s.sampler_cfg, ctx)(params)  # the stored weights stay
    assert widened["layers"]["q"].dtype == jnp.float32
  projections = sum(x.size * 2 for k, x in params["layers"].items()
                    if k in models.transformer.PROJECTIONS)
  assert memory.narrowed_bytes(s.sampler_cfg, params) == projections
  t = rollouts.TrainParts(setup=s, layout=layout, steps=None, engine=None)
  plan = memory.state_plan(t, None, state_lib.abstract_state(s, rl=True))
  assert plan["state"]["rl"]["sampler_copy"] == projections
  off = layout_lib.make_layout(train.build_setup(_config(bf16 + ["rollout.sampler_copy=False"])))
  assert off.sampler_params(params) is params


def test_sampler_tensor_gives_the_sampler_a_tensor_parallel_copy(monkeypatch):
  """``mesh.sampler_tensor=2`` beside FSDP training over 8 devices: the sampler's mesh is
  fsdp 4 x tensor 2 over the same devices with the fsdp_tp rules, its copy of the policy
  splits heads and MLP over ``tensor`` (the same numbers, the policy still FSDP), the engines
  and the trainer's sampling call are built for that mesh and rules, and the memory plan
  counts the copy's bytes per device.
  The rollout devices of the asynchronous trainer take it too; a size that does not divide
  the sampler's devices is one error line; the training mesh's own size and rules share the
  weights as before."""
  from rl_jax.errors import ConfigError  # pylint: disable=import-outside-toplevel
  from rl_jax.train import state as state_lib  # pylint: disable=import-outside-toplevel
  s = train.build_setup(_config(["mesh.num_devices=8", "mesh.sampler_tensor=2"]))
  assert dict(s.sampler_mesh.shape) == dict(data=1, fsdp=4, sequence=1, tensor=2)
  assert set(s.sampler_mesh.devices.flat) == set(s.mesh.devices.flat)
  assert s.sampler_rules == "fsdp_tp" and s.rules == "fsdp" and not s.shared_sampler
  layout = layout_lib.make_layout(s)
  assert layout.decodes_copy and not layout.shared_sampler
  params = models.init_sharded(s.model_cfg, jax.random.key(0), s.mesh, s.rules)
  copy = layout.sampler_params(params)
  P = jax.sharding.PartitionSpec
  assert params["layers"]["q"].sharding.spec == P(None, "fsdp", None, None)
  assert copy["layers"]["q"].sharding.spec == P(None, "fsdp", "tensor", None)
  assert copy["layers"]["up"].sharding.spec == P(None, "fsdp", "tensor")
  assert copy["layers"]["q"].sharding.mesh == s.sampler_mesh
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(copy)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  shard_bytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
                    for x in jax.tree.leaves(copy))
  assert memory._sampler_copy_bytes(s, params) == shard_bytes  # pylint: disable=protected-access
  t = rollouts.TrainParts(setup=s, layout=layout, steps=None, engine=None)
  plan = memory.state_plan(t, None, state_lib.abstract_state(s, rl=True))
  assert plan["state"]["rl"]["sampler_copy"] == shard_bytes
  engine, _ = memory.sampler_engine(t)
  assert engine.ctx == (s.sampler_mesh, sharding.RULES["fsdp_tp"])
  asked = {}  # the trainer's sampling call (rollouts.generate) passes the same mesh and rules
  real = rollout.generate
  monkeypatch.setattr(rollout, "generate", lambda *a, **kw: asked.update(kw) or real(*a, **kw))
  out = rollouts.generate(s, copy, PROMPTS[:2], n=2, temperature=1.0, seed=0)
  assert (asked["mesh"], asked["rules"]) == (s.sampler_mesh, "fsdp_tp")
  assert out.tokens.shape[0] == 4  # 2 prompts x 2 samples
  partial = train.build_setup(_config(["mesh.num_devices=8", "mesh.sampler_tensor=2",
                                       "rollout.partial=True"]))
  assert state_lib.make_engine(partial).ctx == (partial.sampler_mesh, sharding.RULES["fsdp_tp"])

  # int8 sampler weights: the copy is the quantised policy in the sampler's layout (the
  # policy as stored, for the held-out evaluation and the export, is laid out so too)
  quant = train.build_setup(_config(["mesh.num_devices=8", "mesh.sampler_tensor=2",
                                     "rollout.weight_dtype=int8", "loss.tis_level=token"]))
  qlayout = layout_lib.make_layout(quant)
  qcopy = qlayout.sampler_params(params)
  assert all(x.sharding.mesh == quant.sampler_mesh for x in jax.tree.leaves(qcopy))
  qbytes = sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
               for x in jax.tree.leaves(qcopy))
  assert memory._sampler_copy_bytes(  # pylint: disable=protected-access
      quant, params, qlayout.quantize) == qbytes < shard_bytes
  plain = qlayout.sampler_params(params, quantized=False)  # the evaluation's, the export's
  assert plain["layers"]["q"].sharding.spec == P(None, "fsdp", "tensor", None)
  qt = rollouts.TrainParts(setup=quant, layout=qlayout, steps=None, engine=None)
  assert memory.state_plan(qt, None, state_lib.abstract_state(quant, rl=True))[
      "state"]["rl"]["sampler_copy"] >= qbytes

  split = train.build_setup(_config(LAG_ONE + ["mesh.num_devices=0", "mesh.rollout_devices=4",
                                               "mesh.sampler_tensor=2"]))
  assert dict(split.sampler_mesh.shape) == dict(data=1, fsdp=2, sequence=1, tensor=2)
  assert sorted(d.id for d in split.sampler_mesh.devices.flat) == [0, 1, 2, 3]
  with pytest.raises(ConfigError, match="mesh.sampler_tensor=3 does not divide the sampler's "
                     "8 devices"):
    train.build_setup(_config(["mesh.num_devices=8", "mesh.sampler_tensor=3"]))
  same = train.build_setup(_config(["mesh.num_devices=8", "mesh.rules=fsdp_tp",
                                    "mesh.shape.tensor=2", "mesh.shape.fsdp=-1",
                                    "mesh.sampler_tensor=2"]))
  assert same.shared_sampler and same.sampler_mesh is same.mesh
  assert layout_lib.make_layout(same).sampler_params(params) is params  # no copy
