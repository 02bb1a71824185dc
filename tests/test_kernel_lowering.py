"""Shared-prefix attention kernels lower for TPU (Mosaic) and GPU (Triton) at real shapes.

Lowering is shape-only (``jax.ShapeDtypeStruct`` inputs, no data), so it runs on this CPU
machine and catches block-shape, layout and lowering-rule errors without hardware.
"""

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels

S = jax.ShapeDtypeStruct
_TRITON = "__gpu$xla.gpu.triton"
# Platform -> (kernel backend, custom-call target that carries a Pallas kernel).
_TARGETS = {"tpu": ("tpu", "tpu_custom_call"), "cuda": ("gpu", _TRITON)}

# (G, M, R, N, K, H, P, dtype) in the legend of rl_jax/models/transformer.py: P from 1K to
# 32K, R from 256 to 4K, H 64 and 128, GQA 1 to 8, and an R / P that are not multiples of
# the blocks (padded inside the wrapper).
SHAPES = [
    (1, 16, 256, 8, 8, 64, 1024, jnp.bfloat16),
    (2, 8, 512, 8, 2, 64, 4096, jnp.float32),
    (1, 8, 1024, 16, 4, 128, 8192, jnp.bfloat16),
    (1, 4, 4096, 32, 4, 128, 32768, jnp.bfloat16),
    (1, 4, 1000, 8, 1, 128, 3000, jnp.bfloat16),
]


def _abstract_inputs(g, m, r, n, k, h, p, dtype):
  return (S((g, m, r, n, h), dtype), S((g, p, k, h), dtype), S((g, p, k, h), dtype),
          S((g, m, r, k, h), dtype), S((g, m, r, k, h), dtype), S((g,), jnp.int32))


@pytest.fixture(autouse=True)
def verified_modules(monkeypatch):
  """Run MLIR's verifier on every Triton and Mosaic module Pallas builds: the device's
  compiler rejects an op that fails it (e.g. a loop whose bounds have different integer
  types, seen on an H100), which export alone, never compiling the kernel, lets through.
  Returns the platforms of the modules verified, one entry each."""
  from jax._src.pallas.mosaic import pallas_call_registration as mosaic  # pylint: disable=import-outside-toplevel
  from jax._src.pallas.triton import pallas_call_registration as triton  # pylint: disable=import-outside-toplevel
  seen = []

  def verifying(lower, platform, module_of):
    def lower_and_verify(*args, **kwargs):
      result = lower(*args, **kwargs)
      module_of(result).operation.verify()  # raises MLIRError naming the failing op
      seen.append(platform)
      return result
    return lower_and_verify

  monkeypatch.setattr(triton.lowering, "lower_jaxpr_to_triton_module", verifying(
      triton.lowering.lower_jaxpr_to_triton_module, "cuda", lambda r: r.module))
  monkeypatch.setattr(mosaic.lowering, "lower_jaxpr_to_pipelined_module", verifying(
      mosaic.lowering.lower_jaxpr_to_pipelined_module, "tpu", lambda m: m))
  return seen


def _export(fn, platform, args):
  return jax.export.export(
      jax.jit(fn), platforms=[platform],
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(_TRITON)])(*args)


def _attention(backend):
  def attn(q, k_ctx, v_ctx, k_resp, v_resp, lengths):
    return pallas_kernels.shared_prefix_attention(q, k_ctx, v_ctx, k_resp, v_resp, lengths,
                                                  backend=backend)
  return attn


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "G{}M{}R{}N{}K{}H{}P{}".format(*s[:7]))
def test_forward_lowers(platform, shape):
  backend, target = _TARGETS[platform]
  args = _abstract_inputs(*shape)
  exported = _export(_attention(backend), platform, args)
  assert exported.platforms == (platform,)
  assert exported.out_avals[0].shape == args[0].shape
  assert exported.out_avals[0].dtype == args[0].dtype
  assert exported.mlir_module().count(target) == 1  # the forward kernel, nothing else


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "G{}M{}R{}N{}K{}H{}P{}".format(*s[:7]))
def test_gradient_lowers(platform, shape, verified_modules):
  backend, target = _TARGETS[platform]
  args = _abstract_inputs(*shape)
  attn = _attention(backend)

  def loss(q, k_ctx, v_ctx, k_resp, v_resp, lengths):
    return jnp.sum(attn(q, k_ctx, v_ctx, k_resp, v_resp, lengths).astype(jnp.float32))

  exported = _export(jax.grad(loss, argnums=(0, 1, 2, 3, 4)), platform, args)
  assert exported.platforms == (platform,)
  assert [a.shape for a in exported.out_avals] == [a.shape for a in args[:5]]
  assert all(a.dtype == args[0].dtype for a in exported.out_avals)
  # Forward (recomputed for the residuals) + dq + context dK/dV + response dK/dV.
  assert exported.mlir_module().count(target) == 4
  assert verified_modules == [platform] * 4


def test_illegal_tpu_block_is_rejected_before_lowering():
  args = _abstract_inputs(1, 2, 1024, 4, 2, 64, 2048, jnp.bfloat16)

  def attn(*a):
    return pallas_kernels.shared_prefix_attention(
        *a, backend="tpu", block_sizes=pallas_kernels.BlockSizes(64, 64, 64, 64))

  with pytest.raises(ValueError, match="multiples of 128"):
    _export(attn, "tpu", args)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_sampler_decode_program_lowers_with_the_paged_kernel(platform, verified_modules):
  """The sampler's whole decode loop (``rollout.decode.decode``, bf16, pages of 64 tokens,
  8 live pages per sample), traced for the platform (``prefix_attention="auto"`` picks the
  kernel path there), lowers with the paged-attention kernel in every layer: the prompt's
  part in jnp, each sample's pages read in place by ``pallas_kernels.paged_decode_attention``."""
  from rl_jax import models  # pylint: disable=import-outside-toplevel
  from rl_jax.rollout import decode, records, sampler  # pylint: disable=import-outside-toplevel
  cfg = models.ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                           num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                           max_position_embeddings=4096, dtype="bfloat16")
  G, M, P, R, page = 4, 4, 256, 512, 64
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  state = jax.eval_shape(lambda: sampler.init_state(cfg, G, M, P, R, S=page, pages=64))
  sp, filtered = records.sampling_params(cfg, 1.0, 0, 1.0, [1], None)
  i32 = S((), jnp.int32)
  jax.clear_caches()  # the platform is read at trace time: no trace for another one
  with pallas_kernels.target_platform("gpu" if platform == "cuda" else platform):
    exported = _export(lambda p, s, sp_, v, n, f: decode.decode(
        cfg, p, s, sp_, v, n, f, decode.NEVER, filtered=filtered, live=R // page),
        platform, (params, state, sp, i32, i32, i32))
  text = exported.mlir_module()
  assert _TARGETS[platform][1] in text and "paged_decode_attention" in text
  assert platform in verified_modules  # (the layers' identical calls lower once)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_re_prefill_programs_lower_for_the_platform(platform):
  """The re-prefill of preempted or held samples (``prefill.resume``) and its later chunks
  (``extend.prefill_tail``, attending the prompt and the sample's pages before the chunk),
  bf16 on pages of 64 tokens, lower for the platform: the programs a run with a fixed pool or
  held groups calls and the TPU plan compiles (``topology._reprefill_programs``)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from rl_jax import models  # pylint: disable=import-outside-toplevel
  from rl_jax.rollout import extend, prefill, sampler, slots  # pylint: disable=import-outside-toplevel
  cfg = models.ModelConfig(vocab_size=512, hidden_size=256, intermediate_size=512,
                           num_layers=2, num_heads=8, num_kv_heads=2, head_dim=128,
                           max_position_embeddings=4096, dtype="bfloat16")
  G, M, P, R, page, chunk = 4, 4, 256, 512, 64, 128
  params = jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0)))
  state = jax.eval_shape(lambda: sampler.init_state(cfg, G, M, P, R, S=page, pages=64))
  Br, T = slots.resume_shape(G * M, R, G=G, M=M, R=R, chunk=chunk)
  assert (Br, T) == (16, chunk)
  res = prefill.Resume(*(S(np.shape(x), jnp.int32) for x in slots.resume_rows(Br, T, G)))
  jax.clear_caches()  # the platform is read at trace time: no trace for another one
  with pallas_kernels.target_platform("gpu" if platform == "cuda" else platform):
    whole = _export(lambda p, s, r: prefill.resume(cfg, p, s, r), platform,
                    (params, state, res))
    tail = _export(lambda p, s, r, k: extend.prefill_tail(cfg, p, s, r, k), platform,
                   (params, state, res, S((Br,), jnp.int32)))
  for exported in (whole, tail):
    assert exported.platforms == (platform,)
    assert [o.shape for o in exported.out_avals] == [
        x.shape for x in jax.tree.leaves(state)]
