"""Model parity with `transformers`, HF round trips and input validation."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers

from rl_jax import models
from rl_jax.errors import ModelError
from tests.hf_utils import hf_logits, tiny_hf_model

CASES = [
    dict(arch="llama"),  # GQA, untied
    dict(arch="llama", kv_heads=4, tied=True),  # MHA, tied
    dict(arch="llama", attention_bias=True, hidden=40, heads=5, kv_heads=1, inter=50, vocab=37),
    dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 16}),
    dict(arch="qwen2"),
    dict(arch="qwen2", tied=True, kv_heads=1),
    dict(arch="qwen2", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                     "original_max_position_embeddings": 32}),
    dict(arch="qwen3", head_dim=16),
    dict(arch="qwen3", tied=True, head_dim=10, heads=6, kv_heads=3),
]


def _tokens(vocab, B=2, T=19, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int32)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items())[:60])
def test_logits_match_transformers(tmp_path, case):
  model = tiny_hf_model(path=tmp_path, **case)
  cfg, params = models.load_hf(str(tmp_path), dtype=jnp.float32)
  tokens = _tokens(cfg.vocab_size)
  ours = np.asarray(jax.jit(models.forward, static_argnums=0)(cfg, params, jnp.asarray(tokens)))
  ref = hf_logits(model, tokens)
  assert ours.shape == ref.shape
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_save_hf_loads_in_transformers(tmp_path, arch):
  cfg = models.ModelConfig(vocab_size=53, hidden_size=32, intermediate_size=40, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, architecture=arch,
                           qkv_bias=arch == "qwen2", qk_norm=arch == "qwen3",
                           tie_word_embeddings=arch == "qwen3")
  params = models.init_params(cfg, jax.random.key(3), std=0.1)
  out = models.save_hf(cfg, params, str(tmp_path / "export"))
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = _tokens(cfg.vocab_size, T=11)
  np.testing.assert_allclose(hf_logits(model, tokens),
                             np.asarray(models.forward(cfg, params, jnp.asarray(tokens))),
                             atol=1e-4, rtol=0)
  cfg2, params2 = models.load_hf(out)
  assert cfg2.replace(bos_token_id=None, eos_token_id=None) == cfg
  jax.tree.map(np.testing.assert_array_equal, params, params2)


def test_save_hf_sharded_files_roundtrip(tmp_path):
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                           num_heads=4, num_kv_heads=2, head_dim=8)
  params = models.init_params(cfg, jax.random.key(0))
  out = models.save_hf(cfg, params, str(tmp_path / "m"), max_shard_bytes=20_000)
  assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
  assert len([f for f in os.listdir(out) if f.endswith(".safetensors")]) > 1
  _, params2 = models.load_hf(out)
  jax.tree.map(np.testing.assert_array_equal, params, params2)
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = _tokens(64, T=7)
  np.testing.assert_allclose(hf_logits(model, tokens),
                             np.asarray(models.forward(cfg, params, jnp.asarray(tokens))), atol=1e-4)


def test_bfloat16_compute_close_to_float32(tmp_path):
  tiny_hf_model("llama", tmp_path)
  cfg, params = models.load_hf(str(tmp_path))
  cfg16, params16 = models.load_hf(str(tmp_path), dtype=jnp.float32, compute_dtype="bfloat16")
  assert params16["embed"].dtype == jnp.float32  # float32 master weights, bf16 compute
  tokens = jnp.asarray(_tokens(cfg.vocab_size))
  a = models.forward(cfg, params, tokens)
  b = models.forward(cfg16, params16, tokens)
  assert b.dtype == jnp.float32
  assert float(jnp.max(jnp.abs(a - b))) < 0.05
  assert float(jnp.max(jnp.abs(a - b))) > 0  # really computed in bf16


def test_remat_and_chunked_logprobs_match_plain(tmp_path):
  tiny_hf_model("qwen2", tmp_path)
  cfg, params = models.load_hf(str(tmp_path))
  tokens = jnp.asarray(_tokens(cfg.vocab_size, T=23))
  plain = lambda p, t: jnp.take_along_axis(  # log-softmax of the whole logits at temperature t
      jax.nn.log_softmax(models.forward(cfg, p, tokens)[:, :-1] / t), tokens[:, 1:, None],
      -1)[..., 0]
  ref, g0 = jax.jit(lambda p: (plain(p, 0.7), jax.grad(lambda q: plain(q, 1.0).sum())(p)))(params)
  for remat, chunk in [("none", 512), ("full", 5), ("dots", 7)]:  # one program each
    c = cfg.replace(remat=remat, logits_chunk=chunk)
    lp, g = jax.jit(lambda p: (  # pylint: disable=cell-var-from-loop
        models.sequence_logprobs(c, p, tokens, temperature=0.7),
        jax.grad(lambda q: models.sequence_logprobs(c, q, tokens).sum())(p)))(params)
    np.testing.assert_allclose(lp[:, 1:], ref, atol=2e-5)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=2e-5, rtol=1e-4), g, g0)


def test_attention_mask_matches_unpadded(tmp_path):
  tiny_hf_model("llama", tmp_path)
  cfg, params = models.load_hf(str(tmp_path))
  tokens = _tokens(cfg.vocab_size, B=1, T=9)
  padded = np.concatenate([tokens, np.zeros((1, 4), np.int32)], axis=1)
  mask = np.arange(13)[None] < 9
  a = models.forward(cfg, params, jnp.asarray(tokens))
  b = models.forward(cfg, params, jnp.asarray(padded), attention_mask=jnp.asarray(mask))
  np.testing.assert_allclose(a, b[:, :9], atol=1e-5)


# ------------------------------------------------------------------------------ bad input
def test_missing_directory_and_files(tmp_path):
  with pytest.raises(ModelError, match="does not exist"):
    models.load_hf(str(tmp_path / "nope"))
  with pytest.raises(ModelError, match="config.json is missing"):
    models.load_hf(str(tmp_path))
  tiny_hf_model("llama", tmp_path)
  os.remove(tmp_path / "model.safetensors")
  with pytest.raises(ModelError, match="no \\*.safetensors"):
    models.load_hf(str(tmp_path))


def test_corrupt_safetensors(tmp_path):
  tiny_hf_model("llama", tmp_path)
  with open(tmp_path / "model.safetensors", "r+b") as f:
    f.write(b"\xff" * 64)
  with pytest.raises(ModelError, match="corrupt"):
    models.load_hf(str(tmp_path))


def test_unsupported_architecture(tmp_path):
  tiny_hf_model("llama", tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["model_type"] = "gpt2"
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ModelError, match="model_type 'gpt2' is not supported"):
    models.load_hf(str(tmp_path))


def test_mismatched_shapes(tmp_path):
  tiny_hf_model("llama", tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["intermediate_size"] = 80
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ModelError, match="mlp.gate_proj.weight.*shape"):
    models.load_hf(str(tmp_path))


def test_invalid_config_values():
  with pytest.raises(ModelError, match="not a multiple"):
    models.ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=3, num_kv_heads=2, head_dim=4)
  with pytest.raises(ModelError, match="remat"):
    models.ModelConfig(vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1,
                       num_heads=2, num_kv_heads=2, head_dim=4, remat="some")
