"""Mixture-of-experts RL: the sampler's expert records, router replay in the grouped
log-prob passes, and the routing-mismatch metric."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import models, rollout

# 2 MoE layers around a dense one, 8 experts, top 2, renormalised; float32
CFG = models.ModelConfig(vocab_size=31, hidden_size=32, intermediate_size=48, num_layers=3,
                         num_heads=4, num_kv_heads=2, head_dim=8, architecture="qwen3_moe",
                         qk_norm=True, num_experts=8, num_experts_per_tok=2,
                         moe_intermediate_size=16, norm_topk_prob=True,
                         sparse_layers=(True, False, True), max_position_embeddings=64)
PROMPTS = [[3, 7, 1, 9, 4], [5, 2], [8, 8, 6]]


@pytest.fixture(scope="module")
def sampled():
  params = models.init_params(CFG, jax.random.key(0), std=0.3)
  out = rollout.generate(CFG, params, PROMPTS, n=2, max_new_tokens=6, temperature=1.0, seed=3)
  return params, out


def test_sampler_records_the_experts_of_every_fed_token(sampled):
  params, out = sampled
  assert out.routing.shape == (6, 6, 2, 2)
  # one teacher-forced pass over prompt + response rows (right-padded: causal, so the
  # padding changes nothing before it)
  rows = [PROMPTS[out.prompt_index[b]] + out.tokens[b].tolist() for b in range(6)]
  width = max(map(len, rows))
  seq = jnp.asarray([r + [0] * (width - len(r)) for r in rows])
  _, route = jax.jit(lambda p, t: models.forward(CFG, p, t, return_routing=True))(params, seq)
  ids = np.moveaxis(np.asarray(route.ids), 0, 2)  # [B,T,Y,X]
  for b in range(6):
    p, n = len(PROMPTS[out.prompt_index[b]]), int(out.lengths[b])
    rec = out.routing[b]
    # token j is routed when the decode step feeds it; the last one is never fed
    np.testing.assert_array_equal(np.sort(rec[:n - 1], -1), np.sort(ids[b, p:p + n - 1], -1))
    assert (rec[n - 1:] == -1).all()
