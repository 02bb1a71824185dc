"""Sequence parallelism: mesh sequence = S > 1 splits the grouped log-prob pass along length
with the numbers of S = 1, and cuts per-device activation memory of the packed layout."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import models, sharding
from rl_jax.models import sequence_parallel as sp

CFG = models.ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=40, num_layers=1,
                         num_heads=4, num_kv_heads=2, head_dim=8, architecture="qwen3",
                         qk_norm=True, logits_chunk=7)


def _batch(G=2, M=4, P=16, R=6, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.integers(2, P + 1, G).astype(np.int32)
  lengths[0] = P
  prompts = rng.integers(1, 50, (G, P)).astype(np.int32)
  for g in range(G):
    prompts[g, lengths[g]:] = 0
  resp = rng.integers(1, 50, (G, M, R)).astype(np.int32)
  mask = np.arange(R)[None, None] < rng.integers(1, R + 1, (G, M))[..., None]
  weights = rng.normal(size=(G, M, R)).astype(np.float32)
  return prompts, lengths, resp, mask, weights


@functools.lru_cache(maxsize=None)
def _run(S, shared):
  """Log-probs and parameter gradients on a (sequence=S, fsdp=8/S) mesh."""
  mesh = sharding.make_mesh({"sequence": S, "fsdp": 8 // S})
  params = models.init_params(CFG, jax.random.key(1), std=0.2)
  params = jax.device_put(params, models.param_shardings(CFG, mesh, "fsdp"))
  prompts, lengths, resp, mask, weights = _batch()

  def loss(p):
    lp = models.response_logprobs(CFG, p, prompts, lengths, resp, mask, shared_prefix=shared,
                                  temperature=0.7)
    return jnp.sum(lp * weights), lp

  with sharding.use(mesh, "fsdp"):
    (_, lp), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
  return np.asarray(lp), jax.tree.map(np.asarray, grads)


@pytest.mark.parametrize("shared", [True, False], ids=["packed", "replicated"])
@pytest.mark.parametrize("S", [2, 4])
def test_sequence_split_matches_one_shard(S, shared):
  lp, grads = _run(S, shared)
  lp1, grads1 = _run(1, shared)
  np.testing.assert_allclose(lp, lp1, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=5e-5, rtol=1e-4),
               grads, grads1)


def test_plan_only_inside_sharding_use_with_a_sequence_axis():
  assert sp.plan(64, (16, 4)) is None  # outside sharding.use
  with sharding.use(sharding.make_mesh({"fsdp": 8}), "fsdp"):
    assert sp.plan(64, (16, 4)) is None  # sequence = 1
  mesh = sharding.make_mesh({"sequence": 4, "fsdp": 2})
  with sharding.use(mesh, "data"):  # rules that leave length unsharded
    assert sp.plan(64, (16, 4)) is None
  with sharding.use(mesh, "fsdp"):
    assert sp.plan(64, (16, 4)).S == 4
    assert sp.plan(64, (16, 2)) is None  # M not divisible: the single-shard path


def test_shard_major_row_round_trip():
  prompt = jnp.arange(2 * 8).reshape(2, 8)
  resp = 100 + jnp.arange(2 * 4 * 3).reshape(2, 4, 3)
  row = sp.packed_rows(prompt, resp, 2)
  np.testing.assert_array_equal(row[0, :4 + 6], np.r_[0:4, 100:106])  # shard 0's chunk
  p, r = sp.split_packed(row, 8, 4, 3, 2)
  np.testing.assert_array_equal(p, prompt)
  np.testing.assert_array_equal(r, resp)


# ------------------------------------------------------------------------------ memory
MEM_CFG = models.ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=1,
                             num_heads=2, num_kv_heads=1, head_dim=32)
G, M, P, R = 1, 8, 4096, 512


@functools.lru_cache(maxsize=None)
def _compiled_packed_step(S):
  """jit(value_and_grad(sum of packed log-probs)) compiled for a (sequence=S) mesh."""
  mesh = sharding.make_mesh({"sequence": S, "fsdp": 8 // S})
  params = jax.tree.map(lambda shape, sh: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh),
                        models.param_shapes(MEM_CFG), models.param_shardings(MEM_CFG, mesh, "fsdp"),
                        is_leaf=lambda s: isinstance(s, tuple))

  def loss(p, prompts, lengths, resp):
    return jnp.sum(models.response_logprobs(MEM_CFG, p, prompts, lengths, resp))

  args = (jax.ShapeDtypeStruct((G, P), jnp.int32), jax.ShapeDtypeStruct((G,), jnp.int32),
          jax.ShapeDtypeStruct((G, M, R), jnp.int32))
  with sharding.use(mesh, "fsdp"):
    return jax.jit(jax.value_and_grad(loss)).lower(params, *args).compile()


def test_packed_activation_memory_falls_with_sequence_shards():
  temp = {S: _compiled_packed_step(S).memory_analysis().temp_size_in_bytes for S in (1, 4)}
  print(f"packed step temp bytes per device: S=1 {temp[1]:,}  S=4 {temp[4]:,}  "
        f"({temp[1] / temp[4]:.2f}x)")
  assert temp[1] >= 1.6 * temp[4], temp


def test_packed_program_gathers_the_context_kv():
  K, H = MEM_CFG.num_kv_heads, MEM_CFG.head_dim
  kv = re.compile(rf"= f32\[{G},{P},{K},{H}\]\S* all-gather\(")
  assert kv.search(_compiled_packed_step(4).as_text())
  assert not kv.search(_compiled_packed_step(1).as_text())
