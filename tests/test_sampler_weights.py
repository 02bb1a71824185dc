"""Low-precision rollouts (``rollout.weight_dtype``): the sampler decodes with quantised
projections while the trainer and the evaluation keep the policy's dtype. Checked against
weights dequantised here with NumPy from the stored integers and scales."""

import json

import jax
import numpy as np
import pytest

from rl_jax import config as config_lib
from rl_jax import config_utils, models, train
from rl_jax.errors import ConfigError
from tests.tiny import QUICKSTART, TINY_MODEL

TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=2", "train.batch_groups=2", "rollout.n=4",
    "rollout.temperature=1.0", "train.eval_every=0", "log.tensorboard=False",
    "train.checkpoint_every=0", "model.init_std=0.2",
]


def _numpy_dequantized(cfg, params):
  """Each quantised projection as float32 ``qvalue * scale`` (scales repeated over their
  blocks of ``cfg.quant_block`` entries), computed with NumPy."""
  layers = dict(params["layers"])
  for t in models.quant.targets(cfg):
    q = layers[t]
    values = np.asarray(q.qvalue).astype(np.float32)
    scale = np.asarray(q.scale, np.float32)
    for axis in range(values.ndim):
      if scale.shape[axis] != values.shape[axis]:
        scale = np.repeat(scale, values.shape[axis] // scale.shape[axis], axis=axis)
    layers[t] = values * scale
  return {**params, "layers": layers}


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_sampler_decodes_the_quantised_weights(dtype):
  """The behaviour log-probs of a collected batch are the log-probs of the sampled tokens
  under the weights dequantised with NumPy (not under the trainer's weights), the trainer's
  old log-probs are the float policy's, and the evaluation's weights are not quantised."""
  s = train.build_setup(config_utils.load_config(QUICKSTART, TINY + [
      f"rollout.weight_dtype={dtype}", "train.old_logp_pass=separate"]))
  assert s.sampler_cfg.quant == dtype and s.model_cfg.quant == ""
  assert s.sampler_cfg.quant_block == s.model_cfg.head_dim
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  quantised = t.layout.sampler_weights(state.params)
  kinds = {k: models.quant.is_quantized(v) for k, v in quantised["layers"].items()}
  assert all(kinds[k] for k in models.quant.targets(s.sampler_cfg)), kinds
  assert not any(models.quant.is_quantized(x) for x in jax.tree.leaves(
      t.layout.sampler_params(state.params, quantized=False),
      is_leaf=models.quant.is_quantized))
  batch, info, _ = train.collect(t, state)
  x = batch.inputs
  args = (batch.prompt_tokens, batch.prompt_lengths, batch.tokens, x.mask)
  dequantised = _numpy_dequantized(s.sampler_cfg, jax.device_get(quantised))
  want = models.response_logprobs(s.model_cfg, dequantised, *args)
  mask = np.asarray(x.mask)
  np.testing.assert_allclose(np.asarray(x.behaviour_logp)[mask], np.asarray(want)[mask],
                             rtol=1e-4, atol=1e-4)
  float_logp = np.asarray(x.old_logp)[mask]  # the trainer's pass, float weights
  np.testing.assert_allclose(float_logp, np.asarray(models.response_logprobs(
      s.model_cfg, state.params, *args))[mask], rtol=1e-5, atol=1e-5)
  gap = np.abs(float_logp - np.asarray(x.behaviour_logp)[mask])
  assert gap.max() > 1e-4 and info["reward_mean"] >= 0  # a real gap, the mismatch metrics'


def test_int8_rollouts_train_with_an_is_correction(tmp_path):
  config = config_utils.load_config(QUICKSTART, TINY + [
      "rollout.weight_dtype=int8", "loss.tis_level=token", "train.steps=3"])
  train.train(config, str(tmp_path), progress=False)
  with open(tmp_path / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f if "mismatch_mean" in line]
  assert len(rows) == 3 and all(0 < r["mismatch_mean"] < 0.5 for r in rows)
  assert all(r["update_skipped"] == 0 for r in rows)


@pytest.mark.parametrize("override,message", [
    ("rollout.weight_dtype=int4", "rollout.weight_dtype"),
    ("model.lora.rank=4,model.lora.quant=int8", "already stored int8"),
    ("rollout.speculative=True", "cannot be combined"),
])
def test_bad_sampler_weight_settings_are_one_line(override, message):
  extra = ["rollout.weight_dtype=int8"] if "weight_dtype" not in override else []
  config = config_utils.load_config(QUICKSTART, TINY + extra + override.split(","))
  with pytest.raises(ConfigError, match=message) as e:
    config_lib.validate(config)
  assert "\n" not in str(e.value)


def test_scale_blocks_must_divide_the_projections():
  config = config_utils.load_config(QUICKSTART, TINY + [
      "rollout.weight_dtype=int8", "model.intermediate_size=40"])
  with pytest.raises(ConfigError, match="head_dim=16 entries must be a positive integer"):
    train.build_setup(config)


def test_fsdp_gathers_the_8bit_values_not_the_dequantised_weight():
  """A quantised projection sharded over ``fsdp`` on 4 devices: its matmul all-gathers the
  int8 values and their scales (``quant.gathered``), not a dequantised float copy, and gives
  the einsum of the input with the weight dequantised here with NumPy."""
  import re  # pylint: disable=import-outside-toplevel
  from rl_jax import sharding  # pylint: disable=import-outside-toplevel
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(1, 4, 1, 1), sharding.MESH_AXES)
  cfg = models.ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1,
                           num_heads=4, num_kv_heads=2, head_dim=16, quant="int8",
                           quant_block=16)
  rng = np.random.default_rng(0)
  w = models.quant.quantize(jax.numpy.asarray(rng.normal(size=(64, 4, 16)), jax.numpy.float32),
                            "int8", 0, 16)
  x = jax.numpy.asarray(rng.normal(size=(2, 3, 64)), jax.numpy.float32)
  shard = lambda a: jax.device_put(a, jax.sharding.NamedSharding(
      mesh, jax.sharding.PartitionSpec("fsdp")))
  w = jax.tree.map(shard, w)

  def f(x, w):
    with sharding.use(mesh, sharding.get_rules("fsdp")):
      return models.lora.project(cfg, {"q": w}, "q", "btd,dnh->btnh", x)

  compiled = jax.jit(f).lower(x, w).compile()
  gathered = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-gather\(", compiled.as_text())
  assert ("s8", "64,4,16") in gathered and ("f32", "4,4,16") in gathered, gathered
  assert all(dtype == "s8" for dtype, shape in gathered if shape == "64,4,16"), gathered
  values = np.asarray(w.qvalue).astype(np.float32) * np.repeat(np.asarray(w.scale), 16, 0)
  np.testing.assert_allclose(np.asarray(compiled(x, w)),
                             np.einsum("btd,dnh->btnh", np.asarray(x), values),
                             rtol=1e-5, atol=1e-5)
