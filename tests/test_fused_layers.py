"""The fused SwiGLU MLP (one gate/up matmul, hand-written backward), its LoRA variant and the
unrolled layer loop equal the plain computation they replace: forward values and gradients
(base weights and adapters) to float32 rounding, against autodiff of two separate matmuls and
against central finite differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels
from rl_jax import config_utils, models, train
from rl_jax.errors import ModelError
from rl_jax.models import transformer as tx
from rl_jax.models.config import from_hf_dict
from tests.tiny import QUICKSTART, TINY_MODEL

# the two-matmul MLP the fused one is compared with (the default "auto" fuses it on CPU)
QWEN3 = models.ModelConfig(architecture="qwen3", vocab_size=53, hidden_size=32,
                           intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                           head_dim=8, qk_norm=True, max_position_embeddings=64,
                           fused_mlp=False)
GEMMA = dict(model_type="gemma3_text", vocab_size=41, hidden_size=24, intermediate_size=40,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=12,
             sliding_window=3, layer_types=["sliding_attention", "full_attention"],
             query_pre_attn_scalar=12, max_position_embeddings=64)
# experts in layer 0, a dense SwiGLU MLP in layer 1 (the experts keep their own path)
MOE = dict(model_type="qwen3_moe", vocab_size=37, hidden_size=24, intermediate_size=32,
           moe_intermediate_size=12, num_hidden_layers=2, num_attention_heads=2,
           num_key_value_heads=1, head_dim=12, num_experts=4, num_experts_per_tok=2,
           mlp_only_layers=[1], max_position_embeddings=64)
FAMILIES = {"qwen3": QWEN3, "gemma3": from_hf_dict(GEMMA, fused_mlp=False),
            "qwen3_moe": from_hf_dict(MOE, fused_mlp=False)}


def _plain_mlp(h, wg, wu, wd):
  """The SwiGLU MLP written out with two gate/up matmuls: h [B,T,D] -> [B,T,D]."""
  gate = jnp.einsum("btd,df->btf", h, wg)
  up = jnp.einsum("btd,df->btf", h, wu)
  return jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, wd)


def _mlp_args(seed=0, D=32, F=48):
  ks = jax.random.split(jax.random.key(seed), 5)
  h = jax.random.normal(ks[0], (2, 7, D))
  wg, wu = (0.2 * jax.random.normal(k, (D, F)) for k in ks[1:3])
  wd = 0.2 * jax.random.normal(ks[3], (F, D))
  return (h, wg, wu, wd), jax.random.normal(ks[4], (2, 7, D))


def test_swiglu_mlp_matches_autodiff():
  args, dy = _mlp_args()
  y, vjp = jax.vjp(jax.jit(tx.swiglu_mlp), *args)
  y0, vjp0 = jax.vjp(_plain_mlp, *args)
  np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-5)
  for g, g0 in zip(vjp(dy), vjp0(dy)):
    assert float(jnp.abs(g0).max()) > 0.1
    np.testing.assert_allclose(g, g0, rtol=1e-5, atol=1e-5)


def test_swiglu_mlp_gradient_matches_finite_differences():
  """The hand-written backward against a central difference of the forward along a random
  unit direction in all four inputs."""
  args, dy = _mlp_args(seed=3, D=8, F=12)
  f = lambda *a: jnp.sum(jnp.sin(tx.swiglu_mlp(*a)) * dy)
  keys = jax.random.split(jax.random.key(5), 4)
  d = [jax.random.normal(k, a.shape) for k, a in zip(keys, args)]
  norm = jnp.sqrt(sum(jnp.sum(x * x) for x in d))
  d = [x / norm for x in d]
  eps = 1e-2
  fd = (f(*(a + eps * v for a, v in zip(args, d)))
        - f(*(a - eps * v for a, v in zip(args, d)))) / (2 * eps)
  grads = jax.grad(f, argnums=(0, 1, 2, 3))(*args)
  analytic = sum(jnp.sum(g * v) for g, v in zip(grads, d))
  assert abs(float(analytic)) > 0.01
  np.testing.assert_allclose(float(analytic), float(fd), rtol=1e-3)


def _batch(cfg, seed=0):
  rng = np.random.default_rng(seed)
  G, M, P, R = 2, 3, 5, 6
  pt = jnp.asarray(rng.integers(0, cfg.vocab_size, (G, P)), jnp.int32)
  pl = jnp.asarray([5, 3], jnp.int32)
  rt = jnp.asarray(rng.integers(0, cfg.vocab_size, (G, M, R)), jnp.int32)
  rm = jnp.asarray(rng.random((G, M, R)) < 0.8)
  adv = jnp.asarray(rng.normal(size=(G, M, 1)), jnp.float32)
  return pt, pl, rt, rm, adv


def _loss_fn(cfg, batch):
  """A policy-gradient-like scalar of the packed response log-probs: params -> (loss, lp)."""
  pt, pl, rt, rm, adv = batch

  def loss(p):
    lp = models.response_logprobs(cfg, p, pt, pl, rt, rm, shared_prefix=True)
    return -(adv * lp * rm).sum(), lp

  return loss


def _logprob_grads(cfg, params, seed=0):
  loss = _loss_fn(cfg, _batch(cfg, seed))
  return jax.jit(jax.value_and_grad(loss, has_aux=True))(params)


def _assert_close_trees(g, g0):
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), g, g0)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fused_mlp_and_unrolled_layers_match_plain(family):
  """Two matmuls + autodiff under the layer scan vs the fused MLP with the layers unrolled
  and rematerialised (gemma3: GeGLU, the fused matmul only; qwen3_moe: its dense layer).
  qwen3 through the packed prompt-once log-probs, the others through the logits."""
  cfg = FAMILIES[family]
  params = models.init_params(cfg, jax.random.key(1), std=0.2)
  plain = cfg.replace(fused_mlp=False, scan_layers=True)
  fused = cfg.replace(fused_mlp=True, scan_layers=False, remat="full")
  if family == "qwen3":
    (_, y0), g0 = _logprob_grads(plain, params)
    (_, y), g = _logprob_grads(fused, params)
  else:
    (y0, g0), (y, g) = (_logits_grads(c, params) for c in (plain, fused))
  np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-5)
  _assert_close_trees(g, g0)


TOKENS = jnp.asarray([[1, 5, 7, 2, 9, 11], [3, 0, 4, 4, 8, 1]], jnp.int32)


def _logits_scalar(cfg, params):
  w = jnp.cos(jnp.arange(cfg.vocab_size, dtype=jnp.float32))
  return jnp.sum(jnp.sin(models.forward(cfg, params, TOKENS)) * w)


def _logits_grads(cfg, params):
  """(logits [2,6,V], gradient of a scalar of them) of ``params``."""
  f = jax.jit(lambda p: (models.forward(cfg, p, TOKENS), jax.grad(
      lambda q: _logits_scalar(cfg, q))(p)))
  return f(params)


def _lora_params(cfg, seed=1):
  """Base weights and non-zero random adapters (B != 0, so the adapters change the output)."""
  params = models.init_params(cfg, jax.random.key(seed), std=0.2)
  base, ad = models.lora.split(params)
  key = jax.random.key(seed + 1)
  ad = jax.tree.map(lambda x: x + 0.1 * jax.random.normal(jax.random.fold_in(key, x.size),
                                                          x.shape), ad)
  return base, ad


def _logits_loss(cfg, base):
  """A scalar of the logits as a function of the adapters: adapters -> float."""
  return lambda ad: _logits_scalar(cfg, models.lora.combine(base, ad))


def _has_custom_vjp(cfg, params):
  jaxpr = str(jax.make_jaxpr(lambda p: models.forward(cfg, p, TOKENS))(params))
  return "custom_vjp_call" in jaxpr


@pytest.mark.parametrize("targets", ["gate,up", "down", "q,v"])
def test_fused_mlp_with_lora_matches_unfused(targets):
  """Adapters on gate/up (deltas added to the fused outputs), on down only, or off the MLP
  (the hand-written backward): logits, base and adapter gradients equal those of the
  unfused two-matmul MLP under jax.grad."""
  cfg = QWEN3.replace(lora_rank=3, lora_alpha=6.0,
                      lora_targets=models.lora.parse_targets(targets))
  base, ad = _lora_params(cfg)
  params = models.lora.combine(base, ad)
  fused = cfg.replace(fused_mlp=True)
  assert _has_custom_vjp(fused, params) == (targets == "q,v")
  assert not _has_custom_vjp(cfg, params)

  @jax.jit
  def values_and_grads(base, ad):
    out = []
    for c in (cfg, fused):
      f = lambda b, a, c=c: _logits_loss(c, b)(a)
      out.append((models.forward(c, models.lora.combine(base, ad), TOKENS),
                  jax.grad(f, argnums=(0, 1))(base, ad)))
    return out

  (y0, g0), (y, g) = values_and_grads(base, ad)
  np.testing.assert_allclose(y, y0, rtol=1e-5, atol=1e-5)
  _assert_close_trees(g, g0)
  assert float(jnp.abs(g0[1][targets.split(",")[0]]["b"]).max()) > 1e-2


def test_fused_mlp_adapter_gradient_matches_finite_differences():
  """The adapter gradient through the fused gate/up matmul against a central difference of
  a scalar of the logits along a random unit direction in the adapters."""
  cfg = QWEN3.replace(lora_rank=2, lora_alpha=4.0, lora_targets=("gate", "up", "down"),
                      fused_mlp=True)
  base, ad = _lora_params(cfg, seed=4)
  f = _logits_loss(cfg, base)
  leaves, tree = jax.tree.flatten(ad)
  keys = jax.random.split(jax.random.key(9), len(leaves))
  d = [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves)]
  norm = jnp.sqrt(sum(jnp.sum(x * x) for x in d))
  direction = jax.tree.unflatten(tree, [x / norm for x in d])

  @jax.jit
  def check(ad):
    eps = 1e-2
    shift = lambda sign: jax.tree.map(lambda x, v: x + sign * eps * v, ad, direction)
    fd = (f(shift(1.0)) - f(shift(-1.0))) / (2 * eps)
    grad = jax.grad(f)(ad)
    return fd, sum(jnp.sum(g * v) for g, v in zip(jax.tree.leaves(grad),
                                                   jax.tree.leaves(direction)))

  fd, analytic = check(ad)
  assert abs(float(analytic)) > 0.1
  np.testing.assert_allclose(float(analytic), float(fd), rtol=1e-3)


def test_config_knobs_reach_the_model():
  config = config_utils.load_config(QUICKSTART, TINY_MODEL + [
      "model.fused_mlp=True", "model.scan_layers=False", "sft.steps=0"])
  cfg = train.build_setup(config).model_cfg
  assert cfg.fused_mlp and not cfg.scan_layers
  default = train.build_setup(config_utils.load_config(QUICKSTART, TINY_MODEL + [
      "sft.steps=0"])).model_cfg
  assert default.fused_mlp == "auto"
  off = config_utils.load_config(QUICKSTART, TINY_MODEL + ["model.fused_mlp=False"])
  assert train.build_setup(off).model_cfg.fused_mlp is False
  with pytest.raises(ModelError, match="fused_mlp"):
    models.config.validate(QWEN3.replace(fused_mlp="yes"))


def test_auto_fuses_on_cpu_only():
  """"auto" follows the platform the program is compiled for (the mesh's, which
  ``sharding.use`` enters): the fused MLP (its hand-written backward in the jaxpr) on CPU,
  XLA's two matmuls for TPU and GPU; explicit choices are kept everywhere."""
  params = models.init_params(QWEN3, jax.random.key(0))
  auto = QWEN3.replace(fused_mlp="auto")
  on = tx.fused_mlp_on
  assert on(auto) and _has_custom_vjp(auto, params)  # this host: CPU
  for platform, want in (("cpu", True), ("tpu", False), ("gpu", False), ("cuda", False)):
    with pallas_kernels.target_platform(platform):
      assert on(auto) == want, platform
      assert on(QWEN3.replace(fused_mlp=True)) and not on(QWEN3)
  with pallas_kernels.target_platform("tpu"):
    assert not _has_custom_vjp(auto, params)
