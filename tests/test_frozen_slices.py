"""On the CPU backend the layer scan and the decode's unrolled layer loop read a LoRA model's
frozen bf16 / int4 base without a converted copy of every layer (``transformer._read_frozen``,
``_reread_frozen``), and compute exactly what the plain reads compute: logits, log-probs and
gradients bit for bit."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import models
from rl_jax.models import transformer as tx
from rl_jax.models.config import from_hf_dict

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu",
                                reason="the bit-view slicing is used on the CPU backend only")

TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


@pytest.fixture(autouse=True)
def reread_small_models(monkeypatch):
  """The decode loop's re-read at these toy sizes (by default only from 1 GiB of float32
  copies: ``test_reread_only_where_the_copies_are_large``)."""
  monkeypatch.setattr(tx, "REREAD_MIN_BYTES", 0)


def test_reread_only_where_the_copies_are_large(monkeypatch):
  """The decode loop re-reads a LoRA base from ``REREAD_MIN_BYTES`` of hoisted float32
  copies on: a 1.7B-sized base (28 layers, D 2048, F 6144: 5.3 GiB of copies) yes, a toy
  one no (its hoisted copies cost less than dequantising every step)."""
  monkeypatch.setattr(tx, "REREAD_MIN_BYTES", 1 << 30)
  for cfg, big in ((_dense(), False), (_dense(layers=28, hidden=2048, inter=6144,
                                              head_dim=128), True)):
    params = jax.eval_shape(lambda cfg=cfg: tx.init_params(cfg, jax.random.key(0)))
    assert (tx._reread_stacks(cfg, params["layers"]) is not None) is big
    assert tx._frozen_stacks(cfg, params["layers"]) is not None  # the scan's reads: always


def _dense(quant="", layers=2, hidden=64, inter=96, head_dim=16):
  return models.ModelConfig(vocab_size=96, hidden_size=hidden, intermediate_size=inter,
                            num_layers=layers, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                            architecture="qwen3", qk_norm=True, dtype="bfloat16",
                            param_dtype="bfloat16", remat="full", lora_rank=4,
                            lora_targets=TARGETS, quant=quant, quant_block=16,
                            # the two-matmul MLP the byte bounds below were sized for (the
                            # fused one adds one layer's concatenated [D,2F] gate/up weight)
                            fused_mlp=False)


def _moe():
  return from_hf_dict(dict(model_type="qwen3_moe", vocab_size=59, hidden_size=36,
                           intermediate_size=44, moe_intermediate_size=20, num_hidden_layers=3,
                           num_attention_heads=6, num_key_value_heads=2, head_dim=10,
                           num_experts=6, num_experts_per_tok=3, norm_topk_prob=True,
                           mlp_only_layers=[2], max_position_embeddings=128),
                      dtype="bfloat16", param_dtype="bfloat16", lora_rank=2,
                      lora_targets=("q", "k", "v", "o"))


def _gemma():
  return from_hf_dict(dict(model_type="gemma3_text", vocab_size=67, hidden_size=40,
                           intermediate_size=56, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=1, head_dim=12, sliding_window=3,
                           layer_types=["sliding_attention", "full_attention",
                                        "sliding_attention", "sliding_attention"],
                           max_position_embeddings=128),
                      dtype="bfloat16", param_dtype="bfloat16", remat="dots", lora_rank=2,
                      lora_targets=TARGETS)


@functools.partial(jax.jit, static_argnums=0)
def _params(cfg):
  """Random parameters with non-zero adapters (B != 0)."""
  params = tx.init_params(cfg, jax.random.key(0), std=0.1)
  base, ad = models.lora.split(params)
  ad = jax.tree.map(lambda a: a + 0.05 * jax.random.normal(jax.random.key(a.size), a.shape,
                                                           a.dtype), ad)
  return base, ad


def _loss(cfg, ad, base, tokens):
  p = models.lora.combine(base, ad)
  return tx.sequence_logprobs(cfg, p, tokens).sum()


def _unrolled(cfg, params, tokens):
  """Logits of ``trunk_unrolled`` (the decode's layer loop) over the whole sequence."""
  B, T = tokens.shape
  pos = jnp.broadcast_to(jnp.arange(T), (B, T))
  x = tx.embed(cfg, params, tokens)
  layers = tx.unstack_layers(params, cfg)
  h = tx.trunk_unrolled(cfg, params, layers, x, pos, tx.mask_attend(tx.causal_mask(pos, pos)),
                        [None] * cfg.num_layers)[0]
  return tx.logits_from_hidden(cfg, params, h)


def _plain(monkeypatch):
  """The plain scan: no frozen stacks (what the trunk did before)."""
  monkeypatch.setattr(tx, "_frozen_stacks", lambda cfg, stack: None)


@pytest.mark.parametrize("make,quant", [(_dense, ""), (_dense, "int4"), (_moe, ""),
                                        (_gemma, "")], ids=["bf16", "int4", "moe", "gemma3"])
def test_same_values_bit_for_bit(make, quant, monkeypatch):
  """The layer scan (logits, the adapters' and the base's gradients) and the unrolled layer
  loop the sampler's decode runs, with and without the frozen reads."""
  cfg = make(quant) if quant else make()
  base, ad = _params(cfg)
  tokens = jax.random.randint(jax.random.key(2), (2, 11), 0, cfg.vocab_size)
  params = models.lora.combine(base, ad)
  assert tx._frozen_stacks(cfg, params["layers"]) is not None

  def run():
    out = jax.jit(lambda p, t: (tx.forward(cfg, p, t), _unrolled(cfg, p, t)))(params, tokens)
    if make is _dense:  # the adapters' gradients, and the base's too where it is a float
      argnums = (0,) if quant else (0, 1)
      out += jax.jit(jax.value_and_grad(lambda a, b, t: _loss(cfg, a, b, t), argnums))(
          ad, base, tokens)
    return out

  ours = run()
  _plain(monkeypatch)
  plain = run()
  for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(plain)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def _temp_bytes(cfg, base, ad, tokens):
  grad = jax.jit(jax.grad(lambda a, b, t: _loss(cfg, a, b, t)))
  return grad.lower(ad, base, tokens).compile().memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("quant", ["", "int4"])
def test_no_whole_stack_copy_in_the_update(quant, monkeypatch):
  """The adapters' gradient program no longer holds a converted copy of every layer. bf16:
  its temporaries are below 0.6x the float32 copy (they were 1.5x: the copy plus the rest);
  int4: they fall by at least the int8 copy of the values the CPU backend widened them to."""
  cfg = _dense(quant, layers=8, hidden=256, inter=768, head_dim=64)
  base, ad = jax.eval_shape(lambda: _params(cfg))
  tokens = jax.ShapeDtypeStruct((4, 64), jnp.int32)
  stacks = [a for a in tx._frozen_stacks(cfg, base["layers"]) if a is not None]
  values = sum(int(np.prod(a.shape)) for a in stacks)
  ours = _temp_bytes(cfg, base, ad, tokens)
  if not quant:
    assert ours < 0.6 * 4 * values, (ours, 4 * values)
    return
  _plain(monkeypatch)
  plain = _temp_bytes(cfg, base, ad, tokens)
  assert plain - ours >= 0.95 * values, (plain, ours, values)


def _decode_like(cfg):
  """A while loop of one-token passes through ``trunk_unrolled`` over layers sliced outside
  the loop, as the sampler's decode runs them."""

  def f(params, x):
    layers = tx.unstack_layers(params, cfg)
    pos = jnp.zeros(x.shape[:2], jnp.int32)
    attend = tx.mask_attend(jnp.ones((x.shape[0], 1, 1), bool))

    def body(c):
      h, step = c
      return tx.trunk_unrolled(cfg, params, layers, h, pos, attend,
                               [None] * cfg.num_layers)[0], step + 1

    return jax.lax.while_loop(lambda c: c[1] < 3, body, (x, jnp.int32(0)))[0]

  return f


@pytest.mark.parametrize("quant", ["", "int4"])
def test_no_whole_stack_copy_in_the_decode_loop(quant):
  """Layers sliced outside a while loop: their conversion is no longer hoisted out of it (nor
  scheduled all at once), so the loop holds one layer's converted weights, not all."""
  cfg = _dense(quant, layers=8, hidden=256, inter=768, head_dim=64)
  params = jax.eval_shape(lambda: tx.init_params(cfg, jax.random.key(0)))
  x = jax.ShapeDtypeStruct((4, 1, cfg.hidden_size), jnp.bfloat16)
  temp = lambda: jax.jit(_decode_like(cfg)).lower(params, x).compile().memory_analysis(
      ).temp_size_in_bytes
  stacks = [a for a in tx._frozen_stacks(cfg, params["layers"]) if a is not None]
  f32_copy = sum(int(np.prod(a.shape)) * 4 for a in stacks)
  assert 4 * temp() < f32_copy  # without the re-read: more than the whole float32 copy
