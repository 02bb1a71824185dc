"""``model.prefix_attention="concat"`` (one masked softmax over [context | own] keys) equals
the two-region shared-prefix attention it replaces: outputs and gradients of the attention
alone, and log-probs and parameter gradients of the packed training pass, to float32
rounding; and the config knob reaches the trainer's model."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config_utils, models, sharding, train
from rl_jax.errors import ModelError
from rl_jax.models import transformer as tx
from tests.test_fused_layers import QWEN3, _assert_close_trees, _logprob_grads
from tests.tiny import QUICKSTART, TINY_MODEL

import pallas_kernels


@functools.partial(jax.jit, static_argnames=("seed", "G", "M", "R", "P", "N", "K", "H"))
def _attention_args(seed=0, G=2, M=3, R=5, P=4, N=4, K=2, H=8):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = jax.random.normal(ks[0], (G, M, R, N, H))
  k_ctx, v_ctx = (jax.random.normal(k, (G, P, K, H)) for k in ks[1:3])
  k_resp, v_resp = (jax.random.normal(k, (G, M, R, K, H)) for k in ks[3:5])
  dy = jax.random.normal(ks[5], q.shape)
  return (q, k_ctx, v_ctx, k_resp, v_resp), dy


@pytest.mark.parametrize("lengths", [(4, 1), (2, 3)])
def test_concat_attention_matches_reference(lengths):
  """Values and the gradients in all five inputs, with ragged context lengths (padded
  context keys must stay invisible: perturbing them changes nothing)."""
  args, dy = _attention_args()
  lengths = jnp.asarray(lengths, jnp.int32)
  ref = lambda *a: pallas_kernels.shared_prefix_attention_reference(*a, ctx_lengths=lengths)
  new = jax.jit(lambda *a: tx.concat_prefix_attention(*a, lengths))  # one program
  np.testing.assert_allclose(new(*args), ref(*args), rtol=1e-5, atol=1e-6)
  grads = [jax.jit(jax.grad(lambda *a, f=f: jnp.sum(f(*a) * dy), argnums=tuple(range(5))))(*args)
           for f in (ref, new)]
  _assert_close_trees(grads[1], grads[0])
  assert float(jnp.max(jnp.abs(grads[0][0]))) > 0.01  # the check has something to compare
  # the context keys past each group's length are not attended

  @jax.jit  # one program, not op by op
  def moved_fn(q, k_ctx, v_ctx, k_resp, v_resp):
    junk = jnp.arange(k_ctx.shape[1])[None, :, None, None] >= lengths[:, None, None, None]
    return tx.concat_prefix_attention(q, jnp.where(junk, 50.0, k_ctx),
                                      jnp.where(junk, -7.0, v_ctx), k_resp, v_resp, lengths)

  moved = moved_fn(*args)
  np.testing.assert_allclose(moved, new(*args), rtol=1e-6, atol=1e-6)


def test_concat_attention_keeps_the_query_dtype():
  args, _ = _attention_args()
  bf16 = lambda *a: tx.concat_prefix_attention(*(x.astype(jnp.bfloat16) for x in a[:5]), a[5])
  out = jax.jit(bf16)(*args, jnp.asarray([4, 2], jnp.int32))  # one program, not op by op
  assert out.dtype == jnp.bfloat16 and out.shape == args[0].shape


def test_concat_packed_logprobs_and_grads_match_kernel_path():
  """The packed prompt-once pass (ragged prompts, masked responses) with either attention:
  the same log-probs and parameter gradients to float32 rounding."""
  params = models.init_params(QWEN3, jax.random.key(1), std=0.2)
  (_, y0), g0 = _logprob_grads(QWEN3.replace(prefix_attention="kernel"), params)
  (_, y), g = _logprob_grads(QWEN3.replace(prefix_attention="concat"), params)
  np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-5)
  _assert_close_trees(g, g0)


def test_prefix_attention_is_validated_and_reaches_the_trainer():
  with pytest.raises(ModelError, match="prefix_attention"):
    models.config.validate(QWEN3.replace(prefix_attention="flash"))
  config = config_utils.load_config(QUICKSTART, TINY_MODEL + [
      "model.prefix_attention=concat", "sft.steps=0"])
  assert train.build_setup(config).model_cfg.prefix_attention == "concat"
  default = config_utils.load_config(QUICKSTART, TINY_MODEL + ["sft.steps=0"])
  assert train.build_setup(default).model_cfg.prefix_attention == "auto"


def test_auto_is_concat_on_cpu_and_the_kernel_on_tpu_and_gpu():
  """"auto" follows the platform the program is compiled for (the mesh's, which
  ``sharding.use`` enters), not the host's; explicit choices are kept everywhere. The TPU
  choice is also checked through a compile: tests/test_tpu_compile.py finds the Mosaic kernel
  in the quickstart's default programs compiled for v5e."""
  path = models.grouped.prefix_attention_path
  assert path("auto") == "concat"  # this host: CPU
  for platform, want in (("cpu", "concat"), ("tpu", "kernel"), ("gpu", "kernel"),
                         ("cuda", "kernel"), ("rocm", "kernel")):
    with pallas_kernels.target_platform(platform):
      assert path("auto") == want, platform
      assert path("kernel") == "kernel" and path("concat") == "concat"
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
  with sharding.use(mesh, sharding.get_rules("fsdp")):
    assert path("auto") == "concat"
