"""QLoRA: block quantisation against numpy, its error bound, the quantised model against the
LoRA model on the dequantised base, gradients of the adapters, config errors, the memory plan,
the LoRA update on 8 fake devices against 1, a trainer run that checkpoints, resumes and
exports the quantised base, and an HF checkpoint quantised after loading."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import checkpoint, config_utils, models, train
from rl_jax.errors import ConfigError
from rl_jax.train import memory, resume
from tests.test_train_hf import ROOT, qwen3_checkpoint
from tests.tiny import QUICKSTART, TINY_MODEL, compiled_rl_update

QMAX = {"int8": 127, "int4": 7}


def _cfg(quant="int4", block=8, rank=2):
  return models.ModelConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_layers=2,
                            num_heads=2, num_kv_heads=1, head_dim=16, architecture="qwen3",
                            qk_norm=True, lora_rank=rank, lora_alpha=4.0,
                            lora_targets=("q", "o", "down") if rank else (), quant=quant,
                            quant_block=block)


@functools.partial(jax.jit, static_argnums=0)
def _params(cfg):
  """Random params of ``cfg`` with non-zero adapters (B != 0)."""
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  base, ad = models.lora.split(params)
  ad = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(x.size), x.shape), ad)
  return models.lora.combine(base, ad)


def _np_scales(w, axis, block, qmax):
  """Independent symmetric absmax block scales, repeated over each block: max|w| over the
  ``block`` entries along ``axis`` / (qmax + 1/2)."""
  w = np.moveaxis(np.asarray(w, np.float32), axis, -1)
  blocks = w.reshape(*w.shape[:-1], -1, block)
  scale = np.abs(blocks).max(-1, keepdims=True) / np.float32(qmax + 0.5)
  return np.moveaxis(np.broadcast_to(scale, blocks.shape).reshape(w.shape), -1, axis)


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantised_matmul_equals_numpy_dequantise_then_matmul(quant):
  """Each quantised projection holds numpy's block scales and integers within half a step of
  w / scale, and ``project`` (dequantised inside ``qwix.einsum``) equals numpy's
  dequantise-then-matmul of those integers and scales."""
  cfg = _cfg(quant, block=8, rank=0)
  dense = models.init_params(cfg.replace(quant=""), jax.random.key(0), std=0.1)
  params = models.quant.quantize_base(cfg, dense)
  for name, axis, spec, x_dims in [("q", 1, "btd,dnh->btnh", (32,)),
                                   ("down", 1, "btf,fd->btd", (48,)),
                                   ("o", 2, "btnh,nhd->btd", (2, 16))]:
    w = params["layers"][name]
    assert w.qvalue.dtype == jnp.dtype(quant) and w.scale.dtype == jnp.float32
    assert w.scale.shape[axis] * 8 == w.shape[axis]
    scale = _np_scales(dense["layers"][name], axis, 8, QMAX[quant])
    q = np.asarray(w.qvalue, np.int32)
    np.testing.assert_allclose(np.repeat(np.asarray(w.scale), 8, axis=axis), scale, rtol=1e-6)
    assert q.min() >= -QMAX[quant] - 1 and q.max() <= QMAX[quant]
    assert np.all(np.abs(q - np.asarray(dense["layers"][name]) / scale) <= 0.5 + 1e-3)
    w_np = (q * np.repeat(np.asarray(w.scale, np.float64), 8, axis=axis))[1]  # layer 1
    xs = np.random.default_rng(1).normal(size=(2, 3) + x_dims).astype(np.float32)
    lp = jax.tree.map(lambda a: a[1], params["layers"])
    got = models.lora.project(cfg, lp, name, spec, jnp.asarray(xs))
    np.testing.assert_allclose(np.asarray(got), np.einsum(spec, xs, w_np), rtol=1e-5,
                               atol=1e-5)


@pytest.mark.parametrize("quant,bound", [("int8", 0.01), ("int4", 0.15)])
def test_quantisation_error_is_bounded(quant, bound):
  """Every entry is within half a step (scale / 2) of the weight; the relative Frobenius
  error is under 1% (int8) / 15% (int4)."""
  w = jax.random.normal(jax.random.key(3), (2, 32, 48))
  qw = models.quant.quantize(w, quant, 1, 16)
  deq = np.asarray(models.quant.dequantize(qw, jnp.float32))
  step = np.repeat(np.asarray(qw.scale), 16, axis=1)
  assert np.all(np.abs(deq - np.asarray(w)) <= step / 2 + 1e-6)
  assert np.linalg.norm(deq - w) / np.linalg.norm(w) < bound


@pytest.mark.parametrize("quant", ["int4"])  # int8's matmul: the numpy test above
def test_qlora_logits_equal_lora_on_the_dequantised_base(quant):
  """The QLoRA model == the LoRA model whose base is the dequantised weights; with the
  adapters off (the reference) == the plain model on that base."""
  cfg = _cfg(quant)
  params = _params(cfg)
  float_cfg = cfg.replace(quant="")
  deq = models.quant.dequantize_base(cfg, params)
  assert not any(models.quant.is_quantized(x) for x in jax.tree.leaves(
      deq, is_leaf=models.quant.is_quantized))
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 7))
  fwd = jax.jit(models.forward, static_argnums=0)
  np.testing.assert_allclose(fwd(cfg, params, tokens), fwd(float_cfg, deq, tokens),
                             atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(fwd(cfg, models.lora.strip(params), tokens),
                             fwd(float_cfg.replace(lora_rank=0, lora_targets=()),
                                 models.lora.strip(deq), tokens), atol=1e-5, rtol=1e-5)
  # model.fused_mlp leaves a quantised base's projections to the quantised matmul
  for c, p in ((cfg, params), (cfg.replace(lora_rank=0, lora_targets=()),
                               models.lora.strip(params))):
    np.testing.assert_array_equal(fwd(c.replace(fused_mlp=True), p, tokens), fwd(c, p, tokens))
  merged = models.lora.merge(cfg, params)  # adapted weights dequantised + A·B, rest quantised
  assert models.quant.is_quantized(merged["layers"]["k"])
  assert not models.quant.is_quantized(merged["layers"]["q"])
  np.testing.assert_allclose(fwd(cfg.replace(lora_rank=0, lora_targets=()), merged, tokens),
                             fwd(cfg, params, tokens), atol=1e-5, rtol=1e-5)


def test_gradients_reach_the_adapters_only():
  """The trained part of a QLoRA tree is the adapters (the quantised base is frozen), and the
  gradient of an adapter entry matches a central finite difference."""
  cfg = _cfg("int4")
  params = _params(cfg)
  frozen, trained = models.lora.trainable(cfg, params)
  assert models.quant.is_quantized(frozen["layers"]["down"])
  assert set(trained) == {"q", "o", "down"}
  tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 6))

  def loss(ad):
    lp = models.sequence_logprobs(cfg, models.lora.untrainable(cfg, frozen, ad), tokens)
    return -jnp.sum(lp)

  grads = jax.jit(jax.grad(loss))(trained)
  assert jax.tree.structure(grads) == jax.tree.structure(trained)
  g = float(grads["o"]["a"][1, 0, 3, 1])
  assert g != 0.0
  eps = 1e-2
  shift = lambda d: {**trained, "o": {**trained["o"],
                                      "a": trained["o"]["a"].at[1, 0, 3, 1].add(d)}}
  fd = (float(loss(shift(eps))) - float(loss(shift(-eps)))) / (2 * eps)
  np.testing.assert_allclose(g, fd, rtol=2e-2)


@pytest.mark.parametrize("overrides,message", [
    (["model.lora.quant=int8"], r"model.lora.quant='int8' needs model.lora.rank > 0"),
    (["model.lora.rank=4", "model.lora.quant=nf4"], r"config.model.lora.quant must be one of"),
    (["model.lora.rank=4", "model.lora.quant=int4", "model.lora.quant_block=12"],
     r"model.lora.quant_block=12 must be a positive integer dividing hidden_size=32"),
    (["model.lora.rank=4", "model.lora.quant=int8", "loss.preset=ppo"],
     r"model.lora.quant='int8': loss.preset='ppo' trains a critic"),
])
def test_bad_quant_config_fails_in_one_line(overrides, message):
  config = config_utils.load_config(QUICKSTART, TINY_MODEL + overrides)
  with pytest.raises(ConfigError, match=message) as err:
    train.build_setup(config)
  assert "\n" not in str(err.value)


def test_memory_plan_counts_the_quantised_base():
  """The plan's ``policy`` bytes: float32 for the embeddings and norms, and per quantised
  projection entry 1 (int8) or 1/2 (int4) byte plus a float32 scale per block."""
  def policy(quant):
    config = config_utils.load_config(QUICKSTART, TINY_MODEL + [
        "model.lora.rank=4", f"model.lora.quant={quant}", "model.lora.quant_block=16",
        "sft.steps=0", "mesh.num_devices=1"])
    return memory.state_parts(train.abstract_state(train.build_setup(config)))["policy"]

  D, F, N, K, H, L = 32, 64, 2, 1, 16, 1
  n = L * (D * N * H * 2 + D * K * H * 2 + 3 * D * F)  # q, o, k, v, gate, up, down
  dense = policy("")
  assert policy("int8") == dense - 4 * n + n + 4 * n // 16
  assert policy("int4") == dense - 4 * n + n // 2 + 4 * n // 16


@pytest.mark.parametrize("quant", [""])  # "int8" passes too (QLoRA under FSDP), at 2x the time
def test_lora_rl_update_on_8_devices_equals_1(quant):
  """The RL update of LoRA adapters under FSDP on 8 fake devices gives the same new
  parameters as on 1 device; the base is unchanged."""
  def update(n):
    compiled, args, _ = compiled_rl_update(QUICKSTART, TINY_MODEL + [
        "model.lora.rank=4", f"model.lora.quant={quant}", "model.lora.quant_block=16",
        f"mesh.num_devices={n}", "mesh.rules=fsdp", "optim.lr=1e-2"], 8, 4, 4)
    before = jax.device_get(args[0])
    return before, jax.device_get(compiled(*args)[0])

  (b1, p1), (_, p8) = update(1), update(8)
  jax.tree.map(np.testing.assert_array_equal, models.lora.strip(b1), models.lora.strip(p1))
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4), p1, p8)
  ad0, ad1 = models.lora.split(b1)[1], models.lora.split(p1)[1]
  assert any(np.any(a != b) for a, b in zip(jax.tree.leaves(ad0), jax.tree.leaves(ad1)))


# ------------------------------------------------------------------------------ the trainer
QLORA_RUN = TINY_MODEL + [
    "sft.steps=1", "sft.batch_size=8", "train.steps=2", "train.batch_groups=4", "rollout.n=4",
    "train.eval_every=0", "train.checkpoint_every=1", "log.tensorboard=False",
    "model.lora.rank=4", "model.lora.quant=int4", "model.lora.quant_block=16",
    "loss.kl_beta=0.05", "optim.lr=1e-2"]


def _array_bytes(leaves, prefix=""):
  """Bytes of the arrays of a checkpoint manifest (``checkpoint.saved_leaves``) under
  ``prefix``."""
  size = lambda v: 0.5 if v["dtype"] == "int4" else np.dtype(v["dtype"]).itemsize
  return sum(int(np.prod(v["shape"])) * size(v) for p, v in leaves.items()
             if p.startswith(prefix))


def test_qlora_run_keeps_an_int4_base_and_exports_it(tmp_path):
  """A supervised + RL run on an int4 base. Its checkpoints hold the adapters, not the base:
  the supervised stage's name the base the config builds, the RL stage's the merged int4
  base written once into ``checkpoints/base/``, which RL leaves unchanged; each restores
  whole. ``hf`` holds the dequantised base with the adapters merged. (Resuming such a run
  after SIGKILL is bit-exact: ``test_train.test_resume_after_sigkill_is_bit_exact``.)"""
  workdir = str(tmp_path)
  config = config_utils.load_config(QUICKSTART, QLORA_RUN + ["train.keep=3"])
  final = train.train(config, workdir, progress=False)
  s = train.build_setup(config)
  ckpts = os.path.join(workdir, "checkpoints")
  assert checkpoint.all_steps(ckpts) == [1, 2, 3]
  for step, source in ((1, "config"), (2, "stored"), (3, "stored")):
    assert checkpoint.read_metadata(ckpts, step)["lora_base"]["source"] == source
    params = [p for p in checkpoint.saved_leaves(ckpts, step) if p.startswith("params/")]
    assert params and all(p.startswith("params/layers/lora/") for p in params)
  assert checkpoint.all_steps(os.path.join(ckpts, "base")) == [0]  # written once
  adapters = _array_bytes(checkpoint.saved_leaves(ckpts, 3), "params/")
  base = _array_bytes(checkpoint.saved_leaves(os.path.join(ckpts, "base"), 0))
  assert adapters == 4 * sum(int(np.prod(x)) for x in jax.tree.leaves(
      models.lora.adapter_shapes(s.model_cfg), is_leaf=lambda x: isinstance(x, tuple)))
  assert adapters < base / 3  # even on this 1-layer int4 model of width 32
  with checkpoint.Checkpointer(ckpts) as ckpt:
    supervised = resume.restore_state(s, ckpt, 1, train.abstract_state(s, 1))
    state = resume.restore_state(s, ckpt, 3, train.abstract_state(s, 3))
  jax.tree.map(np.testing.assert_array_equal, models.lora.strip(supervised.params),
               models.lora.strip(train.init_state(s).params))  # the supervised stage's base
  base = models.lora.strip(state.params)  # RL changes nothing of the merged int4 base
  assert base["layers"]["up"].qvalue.dtype == jnp.int4
  jax.tree.map(np.testing.assert_array_equal, state.params, final.params)
  # a damaged stored base: the RL checkpoints that read it are set aside, the supervised one
  # (whose base the config builds) restores
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(ckpts, "base", "0", "state"))
           for f in fs]
  victim = max(files, key=os.path.getsize)
  data = bytearray(open(victim, "rb").read())
  data[len(data) // 2] ^= 0xFF
  open(victim, "wb").write(bytes(data))
  with checkpoint.Checkpointer(ckpts) as ckpt:
    assert int(resume.restore_newest(s, ckpt, train.abstract_state(s)).step) == 1
  assert checkpoint.all_steps(ckpts) == [1]
  # the base is set aside too, so the next checkpoint that needs one stores it afresh
  # instead of naming the damaged one again
  assert checkpoint.all_steps(os.path.join(ckpts, "base")) == []
  assert os.path.isdir(os.path.join(ckpts, "base", "0.damaged"))

  cfg, exported = models.load_hf(os.path.join(workdir, "hf"), dtype=jnp.float32)
  tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 9))
  np.testing.assert_allclose(models.forward(cfg, exported, tokens),
                             models.forward(s.model_cfg, final.params, tokens), atol=1e-5)


def test_hf_checkpoint_is_quantised_after_loading(tmp_path):
  """``init_state`` with ``model.hf_path``: the policy's base is the loaded checkpoint
  block-quantised (bit for bit ``quant.quantize_base`` of ``load_hf``) beside fresh adapters."""
  model_dir, data, _ = qwen3_checkpoint(tmp_path)
  config = config_utils.load_config(os.path.join(ROOT, "configs", "gsm8k_hf.py"), [
      f"model.hf_path={model_dir}", f"data.path={data}", f"data.eval_path={data}",
      "data.max_prompt_len=128", "rollout.max_new_tokens=8", "model.lora.rank=4",
      "model.lora.quant=int8", "model.lora.quant_block=16", "mesh.num_devices=1"])
  s = train.build_setup(config)
  state = train.init_state(s)
  _, loaded = models.load_hf(str(model_dir), dtype=jnp.dtype(s.model_cfg.param_dtype))
  want = models.quant.quantize_base(s.model_cfg, loaded)
  got = jax.device_get(models.lora.strip(state.params))
  assert got["layers"]["gate"].qvalue.dtype == jnp.int8
  jax.tree.map(np.testing.assert_array_equal, got, jax.device_get(want))


@pytest.mark.parametrize("quant", ["", "int4", "int8"])
def test_layerwise_merge_equals_the_whole_stack_merge(quant):
  """The HF export's merge, one layer at a time on the host (``lora.merge_layerwise``), gives
  the values of ``lora.merge`` over whole stacks of the dequantised base, bit for bit; a
  stripped tree gives the dequantised base."""
  cfg = _cfg(quant or "int8").replace(quant=quant, param_dtype="bfloat16", dtype="bfloat16")
  params = _params(cfg)
  whole = models.lora.merge(cfg, models.quant.dequantize_base(cfg, params))
  layerwise = models.lora.merge_layerwise(cfg, params)
  assert jax.tree.structure(whole) == jax.tree.structure(layerwise)
  for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(layerwise)):
    assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
  base = models.lora.merge_layerwise(cfg, models.lora.strip(params))
  plain = models.quant.dequantize_base(cfg, models.lora.strip(params))
  for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(base)):
    assert np.array_equal(np.asarray(a), np.asarray(b))


def test_hf_export_merges_layer_by_layer_to_the_same_files(tmp_path):
  """``save_hf`` of a QLoRA tree (merging and dequantising each layer as it writes it) writes
  the files ``save_hf`` writes of the whole-stack merge of the dequantised base, byte for
  byte; the stripped tree gives the dequantised base's files."""
  cfg = _cfg("int4").replace(param_dtype="bfloat16", dtype="bfloat16")
  params = _params(cfg)
  read = lambda d: {f: open(os.path.join(d, f), "rb").read() for f in sorted(os.listdir(d))}
  for tree, whole in ((params, models.lora.merge(cfg, models.quant.dequantize_base(cfg, params))),
                      (models.lora.strip(params),
                       models.quant.dequantize_base(cfg, models.lora.strip(params)))):
    ours = models.save_hf(cfg, tree, str(tmp_path / "ours"))
    ref = models.save_hf(cfg, whole, str(tmp_path / "ref"))
    assert read(ours) == read(ref)
