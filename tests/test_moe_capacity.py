"""Expert capacity and all-to-all expert parallelism (``moe.capacity_mlp``) on 8 fake CPU
devices, against the dropless path and an independent numpy computation.

Priority order of the capacity (``rl_jax/models/moe.py``): each token shard (the batch rows a
device holds) fills each expert's C = ceil(factor · N · X / E) slots in row-major (token,
choice) order; the rest are dropped and add zero to the token's output.

FLOPs: the experts run as a dense batched matmul over [E/n, n·C, D], so the per-device expert
FLOPs are 3 · 2·D·F · (N·X·factor / n) for N tokens on n devices: raising the factor by one
adds exactly the active share of one device, and the whole layer stays far below the E/X
times larger count of a dense matmul of every token with every expert.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from rl_jax import config as config_lib
from rl_jax import config_utils, models, sharding
from rl_jax.errors import ConfigError
from rl_jax.models import moe
from tests.test_moe_rl import MOE_QUICKSTART
from tests.test_moe_sharding import _collectives, _flops
from tests.tiny import TINY_MODEL, compiled_rl_update

B, T, D, E, X, F = 16, 8, 32, 8, 2, 16  # 128 tokens, 16 per device on 8 devices
N_DEV = 8
TOL = 0.35  # cost_analysis over the dot-only count: silu, selects, router-free overhead


def _mesh():
  return sharding.make_mesh({"fsdp": N_DEV})


def _put(mesh, args, axes):
  return [jax.device_put(a, NamedSharding(mesh, sharding.logical_to_spec(ax, "fsdp", mesh,
                                                                         a.shape)))
          for a, ax in zip(args, axes)]


_LAYER_AXES = [("batch", "length", None)] * 3 + [("expert", None, None)] * 3


def _layer_args(seed=0):
  """x [B,T,D], weights [B,T,X], ids [B,T,X] (distinct experts per token), experts."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(B, T, D)).astype(np.float32)
  ids = np.argsort(rng.random((B, T, E)) + 0.3 * np.arange(E) / E, axis=-1)[..., :X]
  weights = rng.random((B, T, X)).astype(np.float32)
  ws = [(0.2 * rng.normal(size=s)).astype(np.float32) for s in [(E, D, F), (E, D, F), (E, F, D)]]
  return [x, weights, ids.astype(np.int32), *ws]


def _capacity_layer(factor, mesh):
  def f(*args):
    with sharding.use(mesh, "fsdp"):
      return moe.capacity_mlp(*args, factor)
  return jax.jit(f)


def _numpy_capacity_layer(x, weights, ids, wg, wu, wd, factor, shards):
  """Independent reference: split the batch rows into ``shards``; within a shard walk the
  (token, choice) assignments in row-major order and keep one while its expert has fewer than
  C kept; output = sum over kept assignments of weight · SwiGLU expert(x)."""
  silu = lambda a: a / (1 + np.exp(-a))
  y, dropped = np.zeros_like(x), 0
  rows = x.shape[0] // shards
  cap = math.ceil(factor * rows * T * X / E)
  for s in range(shards):
    used = np.zeros(E, int)
    for b in range(s * rows, (s + 1) * rows):
      for t in range(T):
        for k in range(X):
          e = ids[b, t, k]
          if used[e] >= cap:
            dropped += 1
            continue
          used[e] += 1
          h = silu(x[b, t] @ wg[e]) * (x[b, t] @ wu[e])
          y[b, t] += weights[b, t, k] * (h @ wd[e])
  return y, dropped


@pytest.mark.parametrize("factor,shape,rules", [
    (0.5, {"fsdp": 8}, "fsdp"), (1.0, {"fsdp": 8}, "fsdp"),
    (0.5, {"fsdp": 4, "tensor": 2}, "fsdp_tp")])
def test_dropped_assignments_and_output_match_numpy(factor, shape, rules):
  """8 devices, all-to-all over fsdp: the dropped count and the output equal the numpy walk
  with one shard per fsdp device (8 shards of 2 batch rows: 16 tokens, C = 2 at factor 0.5,
  4 at factor 1; with fsdp_tp 4 shards and the expert width split over tensor)."""
  args = _layer_args()
  mesh = sharding.make_mesh(shape)
  axes = [("batch", "length", None)] * 3 + [("expert", "embed", "mlp")] * 2 + [
      ("expert", "mlp", "embed")]
  placed = [jax.device_put(a, NamedSharding(mesh, sharding.logical_to_spec(ax, rules, mesh,
                                                                           a.shape)))
            for a, ax in zip(args, axes)]

  def layer(*a):
    with sharding.use(mesh, rules):
      return moe.capacity_mlp(*a, factor)

  y, dropped = jax.jit(layer)(*placed)
  ref, ref_dropped = _numpy_capacity_layer(*args, factor, shape["fsdp"])
  assert ref_dropped > 0
  assert int(dropped) == ref_dropped
  np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=1e-4)
  # one device, one shard: the same walk over all 128 tokens
  y1, dropped1 = jax.jit(lambda *a: moe.capacity_mlp(*a, factor))(*args)
  ref1, ref_dropped1 = _numpy_capacity_layer(*args, factor, 1)
  assert int(dropped1) == ref_dropped1
  np.testing.assert_allclose(np.asarray(y1), ref1, atol=1e-5, rtol=1e-4)


def test_batch_not_split_over_the_experts_is_one_shard():
  """4 batch rows on fsdp = 8 cannot be split: the layer falls back to one shard (the
  weights gathered, no all-to-all) with the numpy walk's drops and output."""
  args = _layer_args()
  args = [a[:4] for a in args[:3]] + args[3:]
  mesh = _mesh()
  layer = _capacity_layer(0.5, mesh)
  placed = _put(mesh, args, _LAYER_AXES)
  y, dropped = layer(*placed)
  ref, ref_dropped = _numpy_capacity_layer(*args, 0.5, 1)
  assert int(dropped) == ref_dropped > 0
  np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=1e-4)
  assert "all-to-all" not in layer.lower(*placed).compile().as_text()


def test_expert_flops_per_device_are_the_capacity_share():
  """Per-device FLOPs of the compiled layer on 8 devices: one more unit of capacity factor
  costs 6·D·F·N·X/n (the active share of a device), the layer at factor 1 is under half of a
  dense every-token-every-expert matmul, and the expert buffers move by all-to-all."""
  args = _layer_args()
  mesh = _mesh()
  placed = _put(mesh, args, _LAYER_AXES)
  compiled = {c: _capacity_layer(c, mesh).lower(*placed).compile() for c in (1.0, 2.0)}
  flops = {c: _flops(k) for c, k in compiled.items()}
  active = 3 * 2 * D * F * (B * T * X) / N_DEV  # per device, factor 1
  dense = 3 * 2 * D * F * (B * T * E) / N_DEV  # every token through every expert
  # the expert matmuls themselves: [slots, D] x [D, F] twice and [slots, F] x [F, D], with
  # slots = E/n · n·C = N·X·factor/n rows per device
  for c, k in compiled.items():
    slots = int(B * T * X * c / N_DEV)
    dots = re.findall(r"= f32\[(\d+),(\d+)\]\{1,0\} dot\(", k.as_text())
    assert sorted(dots) == sorted([(str(slots), str(D)), (str(slots), str(F)),
                                   (str(slots), str(F))]), (c, dots)
  # cost_analysis: one more unit of factor adds the active share (+ its elementwise work:
  # silu, the buffer selects; measured +26%), the layer stays far below dense
  assert active <= flops[2.0] - flops[1.0] <= (1 + TOL) * active, (flops, active)
  assert flops[1.0] <= (1 + TOL) * active, (flops, active)
  assert flops[1.0] < 0.4 * dense, (flops, dense)
  text = compiled[1.0].as_text()
  cap = math.ceil(B * T // N_DEV * X / E)
  # the buffers [n, E/n, C, D] there and back: two all-to-alls of n pieces [1, E/n, C, D]
  piece = f"f32[1,{E // N_DEV},{cap},{D}]"
  exchanges = [l for l in text.split("\n") if re.search(r" all-to-all(-start)?\(", l)]
  assert len(exchanges) == 2, exchanges
  assert all(l.count(piece) == N_DEV for l in exchanges), exchanges
  ops = _collectives(text)
  assert not ops["all-gather"], ops  # no expert weight is gathered
  assert ops["all-reduce"] == ["s32[]"], ops  # the dropped count only


def _tiny_cfg(factor):
  return models.ModelConfig(vocab_size=31, hidden_size=D, intermediate_size=48, num_layers=1,
                            num_heads=4, num_kv_heads=2, head_dim=8, architecture="qwen3_moe",
                            qk_norm=True, num_experts=E, num_experts_per_tok=X,
                            moe_intermediate_size=F, norm_topk_prob=True,
                            sparse_layers=(True,), max_position_embeddings=64,
                            moe_capacity_factor=factor)


def test_large_capacity_equals_dropless_logits_and_gradients():
  """Factor E/X (C = N: no expert can overflow) on 8 devices == the dropless grouped
  matmuls on one device: logits, the gradients of every weight, with router replay."""
  cfg0, cfg8 = _tiny_cfg(0.0), _tiny_cfg(E / X)  # one MoE layer
  params = models.init_params(cfg0, jax.random.key(0), std=0.3)
  rng = np.random.default_rng(2)
  tokens = jnp.asarray(rng.integers(0, 31, (B, T)), jnp.int32)
  # half the tokens replay given (distinct) experts, the others (-1) take the router's
  replay = (rng.integers(0, E, (1, B, T, 1)) + np.arange(X)) % E
  replay = jnp.asarray(np.where(rng.random((1, B, T, 1)) < 0.5, replay, -1), jnp.int32)
  mesh = _mesh()

  def loss(cfg, p, routing):
    logits, route = models.forward(cfg, p, tokens, routing=routing, return_routing=True)
    return jnp.mean(jnp.square(logits)), (logits, route)

  def run(cfg, p, routing):
    return jax.value_and_grad(lambda q: loss(cfg, q, routing), has_aux=True)(p)

  shardings = models.param_shardings(cfg8, mesh, "fsdp")

  def on_mesh(p, routing):
    with sharding.use(mesh, "fsdp"):
      return run(cfg8, p, routing)

  (_, (l0, r0)), g0 = jax.jit(lambda p: run(cfg0, p, replay))(params)
  (_, (l8, r8)), g8 = jax.jit(on_mesh)(jax.device_put(params, shardings), replay)
  np.testing.assert_array_equal(np.asarray(r8.ids), np.asarray(r0.ids))
  given = np.asarray(replay[..., 0]) >= 0
  np.testing.assert_array_equal(np.asarray(r8.ids)[given], np.asarray(replay)[given])
  assert float(jnp.max(r8.dropped)) == 0.0
  np.testing.assert_allclose(np.asarray(l8), np.asarray(l0), atol=1e-5, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-4), g8, g0)


def test_rl_update_with_capacity_runs_all_to_all_and_logs_drops():
  """The RL update of a one-layer MoE policy on 8 devices with factor 1: the expert buffers
  [n, E/n, C, D] go by all-to-all (C = A/n · 1/E per shard of one group's P + M·R tokens),
  never the dropless path's all-reduced [A, D] rows; the metric ``moe_dropped_tokens`` is
  a fraction."""
  G, M, R = 8, 4, 5
  compiled, args, setup = compiled_rl_update(MOE_QUICKSTART, list(TINY_MODEL) + [
      f"model.hidden_size={D}", f"model.num_experts={E}", f"model.moe_intermediate_size={F}",
      "mesh.num_devices=8", "model.moe_capacity_factor=1.0"], G, M, R)
  assert setup.model_cfg.moe_capacity_factor == 1.0
  A = G * (setup.prompt_len + M * R) * X  # assignments of the packed rows
  cap = math.ceil((A // N_DEV) / E)
  ops = _collectives(compiled.as_text())
  piece = f"f32[1,{E // N_DEV},{cap},{D}]"
  assert sum(t.count(piece) for t in ops["all-to-all"]) >= N_DEV, (piece, ops)
  assert not any(f"f32[{A},{D}]" in t for t in ops["all-reduce"]), ops
  mets = compiled(*args)[-1]
  assert 0.0 <= float(mets["moe_dropped_tokens"]) < 1.0


def test_bad_capacity_factor_fails_in_one_line():
  config = config_utils.load_config(MOE_QUICKSTART, ["model.moe_capacity_factor=-0.5"])
  with pytest.raises(ConfigError, match=r"model\.moe_capacity_factor") as e:
    config_lib.validate(config)
  assert "\n" not in str(e.value)
  config = config_utils.load_config(MOE_QUICKSTART, [
      "model.architecture=qwen3", "model.num_experts=0", "model.moe_capacity_factor=1.0"])
  with pytest.raises(ConfigError, match=r"model\.moe_capacity_factor=1\.0 needs"):
    config_lib.validate(config)
