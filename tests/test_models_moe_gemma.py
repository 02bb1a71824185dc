"""Qwen3-MoE and Gemma 3 (text): parity with `transformers`, HF round trips, the packed
layout, the sampler, router replay, expert dispatch and config errors."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from rl_jax import models, rollout, sharding
from rl_jax.errors import ModelError
from rl_jax.models import moe
from rl_jax.models.config import from_hf_dict
from tests.hf_utils import hf_logits

_forward = jax.jit(models.forward, static_argnums=0)

# Gemma 3: window 3 with mixed layer types (sliding, global, sliding, sliding), sequences
# well past the window, a scaled global RoPE, query_pre_attn_scalar and a final soft-cap.
GEMMA = dict(vocab_size=67, hidden_size=40, intermediate_size=56, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=1, head_dim=12, sliding_window=3,
             layer_types=["sliding_attention", "full_attention", "sliding_attention",
                          "sliding_attention"],
             query_pre_attn_scalar=18, final_logit_softcapping=9.0, max_position_embeddings=128,
             rope_parameters={"full_attention": {"rope_type": "linear", "factor": 3.0,
                                                 "rope_theta": 50000.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}})
# Qwen3-MoE: 6 experts, top 3, renormalised; layer 2 dense (mlp_only_layers).
MOE = dict(vocab_size=59, hidden_size=36, intermediate_size=44, moe_intermediate_size=20,
           num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=10,
           num_experts=6, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[2],
           max_position_embeddings=128, tie_word_embeddings=True)


def _randomise(model, gemma: bool, seed: int):
  torch.manual_seed(seed)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_((0.0 if gemma else 1.0) + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.1 * torch.randn_like(p))
  return model


def _build(kind, path, seed=0, **overrides):
  if kind == "gemma3":
    config = transformers.Gemma3TextConfig(**{**GEMMA, **overrides})
    model = transformers.Gemma3ForCausalLM(config)
  else:
    config = transformers.Qwen3MoeConfig(**{**MOE, **overrides})
    model = transformers.Qwen3MoeForCausalLM(config)
  model = _randomise(model.eval(), kind == "gemma3", seed)
  model.save_pretrained(str(path))
  return model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """The two tiny HF models and the same weights loaded by rl_jax."""
  out = {}
  for kind in ("gemma3", "qwen3_moe"):
    path = tmp_path_factory.mktemp(kind)
    model = _build(kind, path)
    cfg, params = models.load_hf(str(path), dtype=jnp.float32)
    out[kind] = (model, cfg, params, path)
  return out


def _tokens(vocab, B=2, T=17, seed=0):
  return np.random.default_rng(seed).integers(0, vocab, (B, T)).astype(np.int32)


# ------------------------------------------------------------------------------ parity
@pytest.mark.parametrize("kind", ["gemma3", "qwen3_moe"])
def test_logits_match_transformers(hf, kind):
  model, cfg, params, _ = hf[kind]
  tokens = _tokens(cfg.vocab_size)
  ours = np.asarray(_forward(cfg, params, jnp.asarray(tokens)))
  np.testing.assert_allclose(ours, hf_logits(model, tokens), atol=1e-4, rtol=0)


def test_config_fields(hf):
  _, g, _, _ = hf["gemma3"]
  assert g.architecture == "gemma3" and g.sliding_window == 3 and g.tie_word_embeddings
  assert g.sliding_layers == (True, False, True, True) and g.rope_local_theta == 500.0
  assert g.rope_theta == 50000.0 and dict(g.rope_scaling)["factor"] == 3.0
  _, m, _, _ = hf["qwen3_moe"]
  assert m.sparse_layers == (True, True, False) and m.moe_layers == (0, 1)
  assert m.expert_params() == 2 * 6 * 3 * 36 * 20
  assert m.active_expert_params() == 2 * 3 * 3 * 36 * 20
  _, _, params, _ = hf["qwen3_moe"]
  n = sum(int(np.prod(a.shape)) for a in jax.tree.leaves(params))
  assert m.num_params() == n
  _, _, gparams, _ = hf["gemma3"]
  assert g.num_params() == sum(int(np.prod(a.shape)) for a in jax.tree.leaves(gparams))


def test_moe_untied_sparse_step_and_unnormalised(tmp_path):
  model = _build("qwen3_moe", tmp_path, seed=1, decoder_sparse_step=2, mlp_only_layers=[],
                 norm_topk_prob=False, tie_word_embeddings=False, num_experts_per_tok=2)
  cfg, params = models.load_hf(str(tmp_path))
  assert cfg.sparse_layers == (False, True, False)
  tokens = _tokens(cfg.vocab_size, T=9, seed=3)
  np.testing.assert_allclose(np.asarray(_forward(cfg, params, jnp.asarray(tokens))),
                             hf_logits(model, tokens), atol=1e-4, rtol=0)


def test_gemma_legacy_rope_fields_and_pattern():
  hf = dict(model_type="gemma3_text", vocab_size=11, hidden_size=8, intermediate_size=8,
            num_hidden_layers=7, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
            sliding_window=16, sliding_window_pattern=3, rope_theta=1e6,
            rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0})
  cfg = from_hf_dict(hf)
  assert cfg.sliding_layers == (True, True, False, True, True, False, True)
  assert cfg.rope_theta == 1e6 and cfg.rope_local_theta == 1e4
  assert dict(cfg.rope_scaling) == {"rope_type": "linear", "factor": 8.0}


# ------------------------------------------------------------------------------ save / load
@pytest.mark.parametrize("kind", ["gemma3", "qwen3_moe"])
def test_save_hf_loads_back_in_transformers(hf, tmp_path, kind):
  _, cfg, params, _ = hf[kind]
  params = jax.tree.map(lambda a: a * 1.1, params)  # not the file's weights
  out = models.save_hf(cfg, params, str(tmp_path / "export"))
  model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
  tokens = _tokens(cfg.vocab_size, T=11, seed=2)
  np.testing.assert_allclose(hf_logits(model, tokens),
                             np.asarray(_forward(cfg, params, jnp.asarray(tokens))),
                             atol=1e-4, rtol=0)
  cfg2, params2 = models.load_hf(out)
  assert cfg2 == cfg
  jax.tree.map(np.testing.assert_array_equal, params, params2)


# ------------------------------------------------------------------------------ packed layout
@pytest.mark.parametrize("kind", ["gemma3", "qwen3_moe"])
def test_shared_prefix_equals_replicated_and_forward(hf, kind):
  _, cfg, params, _ = hf[kind]
  rng = np.random.default_rng(4)
  G, M, P, R = 2, 2, 8, 6
  lengths = np.array([7, 4], np.int32)
  prompts = rng.integers(0, cfg.vocab_size, (G, P)).astype(np.int32)
  responses = rng.integers(0, cfg.vocab_size, (G, M, R)).astype(np.int32)
  args = (jnp.asarray(prompts), jnp.asarray(lengths), jnp.asarray(responses))
  packed = models.response_logprobs(cfg, params, *args, shared_prefix=True)
  replicated = models.response_logprobs(cfg, params, *args, shared_prefix=False)
  np.testing.assert_allclose(packed, replicated, atol=2e-5, rtol=0)
  g, m = 1, 1  # one row by plain teacher forcing (window crossing prompt and response)
  row = np.concatenate([prompts[g, :lengths[g]], responses[g, m]])[None]
  logp = jax.nn.log_softmax(_forward(cfg, params, jnp.asarray(row)))[0]
  ref = [logp[lengths[g] - 1 + j, responses[g, m, j]] for j in range(R)]
  np.testing.assert_allclose(packed[g, m], ref, atol=2e-5, rtol=0)


# ------------------------------------------------------------------------------ sampler
def _hf_greedy(model, prompt, max_new):
  ids = torch.tensor([prompt], dtype=torch.long)
  with torch.no_grad():
    seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
  return seq[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", ["gemma3", "qwen3_moe"])
def test_greedy_generate_matches_transformers(hf, kind):
  model, cfg, params, _ = hf[kind]
  prompts = [[5, 9, 2, 8, 8, 1], [7, 1], [3, 4, 10, 2]]
  out = rollout.generate(cfg, params, prompts, n=1, max_new_tokens=7, temperature=0.0)
  for i, prompt in enumerate(prompts):
    assert out.tokens[i].tolist() == _hf_greedy(model, prompt, 7), i


def test_split_decode_attention_keeps_the_sliding_window_on_pages(hf):
  """``prefix_attention="kernel"``: the decode attends the prompt and the response pages as
  two partial softmaxes merged by log-sum-exp (``decode.split_decode_attention``, the paged
  kernel's path); with pages of 2 tokens and a window of 3 it samples the tokens and
  log-probs of the one-softmax path, which greedy decoding checks against transformers. So
  does the one-softmax path with the prompts on pages (``prompt_pages``), whose forked
  prompt pages the window masks where they are read once per group."""
  _, cfg, params, _ = hf["gemma3"]
  prompts = [[5, 9, 2, 8, 8, 1], [7, 1], [3, 4, 10, 2]]
  run = lambda path, **kw: rollout.generate(dataclasses.replace(cfg, prefix_attention=path),
                                            params, prompts, n=2, max_new_tokens=24, seed=5,
                                            page_size=2, **kw)
  # a fixed pool: a growing one this small is every budget, an identity table that shares
  # no page
  split, joint = run("kernel"), run("auto")
  paged = run("auto", prompt_pages=True, kv_pages=128)
  for out in (split, paged):
    np.testing.assert_array_equal(out.tokens, joint.tokens)
    np.testing.assert_allclose(out.logprobs, joint.logprobs, atol=1e-5, rtol=0)
  assert paged.stats["prefix_pages_shared"] == (6 - 2) // 2 + (4 - 2) // 2  # whole pages forked


# ------------------------------------------------------------------------------ experts
def test_router_replay_and_aux_loss(hf):
  model, cfg, params, _ = hf["qwen3_moe"]
  tokens = jnp.asarray(_tokens(cfg.vocab_size, T=13, seed=5))
  logits, routing = jax.jit(lambda p, t: models.forward(cfg, p, t, return_routing=True))(
      params, tokens)
  assert routing.ids.shape == (2, 2, 13, 3) and routing.logits.shape == (2, 2, 13, 6)
  replay = jax.jit(lambda p, t, r: models.forward(cfg, p, t, routing=r))
  np.testing.assert_array_equal(np.asarray(replay(params, tokens, routing.ids)),
                                np.asarray(logits))
  other = jnp.roll(routing.ids, 1, axis=-1)  # same experts, other order: same output
  np.testing.assert_allclose(replay(params, tokens, other), logits, atol=1e-5)
  # the loss transformers adds (before router_aux_loss_coef), from the same router logits
  from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func
  mask = np.ones((2, 13), bool)
  mask[1, 9:] = False
  ref = load_balancing_loss_func(tuple(torch.tensor(np.asarray(l).reshape(-1, 6))
                                       for l in routing.logits), 6, 3, torch.tensor(mask))
  ours = moe.load_balancing_loss(routing.logits, 3, jnp.asarray(mask))
  np.testing.assert_allclose(float(ours), float(ref), rtol=1e-5)
  assert cfg.router_aux_loss_coef == pytest.approx(0.001)
  with pytest.raises(ValueError, match="mixture-of-experts"):
    models.forward(hf["gemma3"][1], hf["gemma3"][2], tokens, return_routing=True)


def test_dispatch_equals_per_token_loop():
  rng = np.random.default_rng(6)
  B, T, D, E, X, F = 2, 5, 8, 5, 2, 6
  x = rng.normal(size=(B, T, D)).astype(np.float32)
  w_r = rng.normal(size=(D, E)).astype(np.float32)
  w_g, w_u = rng.normal(size=(2, E, D, F)).astype(np.float32)
  w_d = rng.normal(size=(E, F, D)).astype(np.float32)
  weights, ids, _ = moe.route(jnp.asarray(x), jnp.asarray(w_r), X, False)
  out = np.asarray(moe.expert_mlp(jnp.asarray(x), weights, ids, w_g, w_u, w_d))
  silu = lambda z: z / (1 + np.exp(-z))
  ref = np.zeros_like(x)
  for b in range(B):
    for t in range(T):
      z = x[b, t] @ w_r
      p = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
      for e in np.argsort(-p)[:X]:
        ref[b, t] += p[e] * ((silu(x[b, t] @ w_g[e]) * (x[b, t] @ w_u[e])) @ w_d[e])
  np.testing.assert_allclose(out, ref, atol=1e-4, rtol=1e-5)


def test_expert_sharding_rule(hf):
  _, cfg, _, _ = hf["qwen3_moe"]
  axes = models.param_axes(cfg)["moe"]["expert_gate"]
  assert axes == ("layers", "expert", "embed", "mlp")
  assert sharding.logical_to_spec(axes, "fsdp") == jax.sharding.PartitionSpec(
      None, "fsdp", None, None)
  assert sharding.logical_to_spec(axes, "fsdp_tp") == jax.sharding.PartitionSpec(
      None, "fsdp", None, "tensor")


# ------------------------------------------------------------------------------ bad configs
def _hf_dict(kind, **changes):
  base = dict(GEMMA, model_type="gemma3_text") if kind == "gemma3" else dict(
      MOE, model_type="qwen3_moe")
  base.update(changes)
  return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize("kind,changes,field", [
    ("gemma3", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma3", dict(hidden_activation="gelu"), "hidden_activation"),
    ("gemma3", dict(layer_types=["chunked_attention"] * 4), "layer_types"),
    ("gemma3", dict(rope_parameters={"sliding_attention": {"rope_type": "linear", "factor": 2.0},
                                     "full_attention": {"rope_type": "default"}}),
     "sliding_attention"),
    ("qwen3_moe", dict(scoring_func="sigmoid"), "scoring_func"),
    ("qwen3_moe", dict(n_shared_experts=1), "n_shared_experts"),
    ("qwen3_moe", dict(shared_expert_intermediate_size=64), "shared_expert_intermediate_size"),
    ("gemma3", dict(model_type="gemma3"), "model_type"),  # multimodal Gemma 3
    ("qwen3_moe", dict(num_experts_per_tok=None), "num_experts_per_tok"),
    ("qwen3_moe", dict(num_experts_per_tok=9), "num_experts_per_tok"),
])
def test_bad_configs_fail_in_one_line(kind, changes, field):
  with pytest.raises(ModelError) as err:
    from_hf_dict(_hf_dict(kind, **changes))
  assert field in str(err.value) and "\n" not in str(err.value)
  assert isinstance(err.value, ValueError)


def test_bad_config_file_through_load_hf(hf, tmp_path):
  _, _, _, path = hf["qwen3_moe"]
  hf_cfg = json.loads((path / "config.json").read_text())
  hf_cfg["topk_method"] = "noaux_tc"
  (tmp_path / "config.json").write_text(json.dumps(hf_cfg))
  with pytest.raises(ModelError, match="topk_method"):
    models.load_hf(str(tmp_path))
