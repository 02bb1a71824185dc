"""Sampler correctness: HF greedy parity, exact behaviour log-probs, sampling distribution,
prompt-once == replicated, EOS / stop, no recompiles, 8 devices == 1, input errors."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.special
import scipy.stats
import torch

from rl_jax import models, rollout, sharding
from rl_jax.rollout import sampler
from tests.hf_utils import tiny_hf_model

# Shapes shared by most tests (3 prompts -> 4 slots, prompt bucket 8, response bucket 8) so
# the jitted sampler compiles once per model and setting.
PROMPTS = [[5, 9, 2], [7, 1, 3, 3, 8, 4, 6], [11]]
MAX_NEW = 8


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
  """Tiny random HF models (llama, qwen2, qwen3) and the same weights loaded by rl_jax."""
  out = {}
  for arch, kw in [("llama", {}), ("qwen2", {}), ("qwen3", dict(head_dim=16))]:
    path = tmp_path_factory.mktemp(arch)
    model = tiny_hf_model(arch, path, **kw)
    cfg, params = models.load_hf(str(path), dtype=jnp.float32)
    out[arch] = (model, cfg, params)
  return out


def _hf_greedy(model, prompt, max_new):
  ids = torch.tensor([prompt], dtype=torch.long)
  with torch.no_grad():
    seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         min_new_tokens=max_new, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
  return seq[0, len(prompt):].tolist()


_forward = jax.jit(models.forward, static_argnums=0)


def _teacher_forced_logits(cfg, params, prompts, responses):
  """Logits [B,R,V] (float64) predicting each response token, from one batched
  ``models.forward`` over right-padded prompt+response rows."""
  T = max(len(p) for p in prompts) + responses.shape[1]
  tokens = np.zeros((len(prompts), T), np.int32)
  valid = np.zeros((len(prompts), T), bool)
  for b, (p, r) in enumerate(zip(prompts, responses)):
    tokens[b, :len(p) + len(r)] = list(p) + list(r)
    valid[b, :len(p) + len(r)] = True
  logits = np.asarray(_forward(cfg, params, jnp.asarray(tokens), None, jnp.asarray(valid)),
                      np.float64)
  R = responses.shape[1]
  return np.stack([logits[b, len(p) - 1:len(p) - 1 + R] for b, p in enumerate(prompts)])


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_matches_transformers_generate(hf, arch):
  model, cfg, params = hf[arch]
  out = rollout.generate(cfg, params, PROMPTS, n=1, max_new_tokens=MAX_NEW, temperature=0.0)
  assert out.tokens.shape == (3, MAX_NEW) and out.tokens.dtype == np.int32
  for i, prompt in enumerate(PROMPTS):
    assert out.tokens[i].tolist() == _hf_greedy(model, prompt, MAX_NEW)
  assert out.mask.all() and (out.finish_reason == "length").all()
  assert (out.lengths == MAX_NEW).all()
  np.testing.assert_array_equal(out.logprobs, 0.0)  # a greedy token has probability 1


def test_logprobs_equal_teacher_forcing_and_no_recompile(hf):
  _, cfg, params = hf["llama"]
  T = 0.8
  out = rollout.generate(cfg, params, PROMPTS, n=3, max_new_tokens=MAX_NEW, temperature=T,
                         seed=1)
  assert out.tokens.shape == (9, MAX_NEW)
  np.testing.assert_array_equal(out.prompt_index, np.repeat(np.arange(3), 3))
  # Teacher forcing: log_softmax(forward(prompt + response) / T) at each response token.
  rows = [PROMPTS[r // 3] for r in range(9)]
  z = _teacher_forced_logits(cfg, params, rows, out.tokens) / T
  ref = np.take_along_axis(z - scipy.special.logsumexp(z, axis=-1, keepdims=True),
                           out.tokens[..., None], axis=-1)[..., 0]
  np.testing.assert_allclose(out.logprobs, ref, atol=1e-5, rtol=0)
  # the n samples of a prompt differ (independent keys), and the seed matters
  assert len({tuple(r) for r in out.tokens[:3].tolist()}) > 1

  # Same buckets, new prompt values, new weights, new temperature: no retrace.
  before = dict(sampler.TRACE_COUNTS)
  params2 = jax.tree.map(lambda x: x * 1.01, params)
  other = rollout.generate(cfg, params2, [[3, 3], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9]], n=3,
                           max_new_tokens=MAX_NEW - 2, temperature=1.3, seed=2)
  assert dict(sampler.TRACE_COUNTS) == before
  assert other.tokens.shape == (9, MAX_NEW - 2)


def test_sampling_frequencies_match_softmax():
  V, B = 12, 20000
  logits = jnp.asarray(np.random.default_rng(0).normal(0, 1.5, V), jnp.float32)
  uniforms = jax.random.uniform(jax.random.key(0), (B,))

  def draw(temperature, top_k, top_p):
    sp = rollout.SamplingParams(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                                jnp.full((4,), -1, jnp.int32), jnp.full((4, 4), -1, jnp.int32),
                                jnp.zeros((4,), jnp.int32))
    fn = jax.jit(rollout.sample_logits, static_argnames="filtered")
    tok, lp = fn(uniforms, jnp.broadcast_to(logits, (B, V)), sp, filtered=True)
    return np.asarray(tok), np.asarray(lp)

  z = np.asarray(logits, np.float64)
  for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0),
                                    (1.0, 0, 0.8), (0.9, 6, 0.7)]:
    tok, lp = draw(temperature, top_k, top_p)
    # Independent reference: numpy softmax, top-k set, then smallest top-p prefix.
    p = np.exp(z / temperature - np.max(z / temperature))
    order = np.argsort(-z)
    keep = np.zeros(V, bool)
    keep[order[:top_k or V]] = True
    p = np.where(keep, p, 0.0) / np.where(keep, p, 0.0).sum()
    cum = np.cumsum(p[order]) - p[order]
    allowed = np.zeros(V, bool)
    allowed[order[cum < top_p]] = True
    p = np.where(allowed, p, 0.0) / np.where(allowed, p, 0.0).sum()
    assert allowed[tok].all(), "an excluded token was emitted"
    np.testing.assert_allclose(lp, np.log(p[tok]), atol=1e-5)
    counts = np.bincount(tok, minlength=V)[allowed]
    expected = B * p[allowed]
    stat, pvalue = scipy.stats.chisquare(counts, expected)
    assert pvalue > 1e-4, (temperature, top_k, top_p, stat)


def test_prompt_once_equals_replicated_with_filtering(hf):
  _, cfg, params = hf["llama"]
  kw = dict(n=3, max_new_tokens=MAX_NEW, temperature=0.9, top_k=5, top_p=0.9, seed=3)
  once = rollout.generate(cfg, params, PROMPTS, prompt_once=True, **kw)
  rep = rollout.generate(cfg, params, PROMPTS, prompt_once=False, **kw)
  np.testing.assert_array_equal(once.tokens, rep.tokens)
  np.testing.assert_allclose(once.logprobs, rep.logprobs, atol=1e-5)
  assert once.stats["kv_bytes"] < once.stats["kv_bytes_replicated"]
  # End to end: every token is in the top-5 / top-0.9 set of the teacher-forced logits and
  # its log-prob is that of the renormalised filtered distribution.
  zs = _teacher_forced_logits(cfg, params, [PROMPTS[r // 3] for r in range(9)], once.tokens) / 0.9
  for row in range(9):
    resp, z = once.tokens[row].tolist(), zs[row]
    for j, t in enumerate(resp):
      order = np.argsort(-z[j])[:5]
      p = np.exp(z[j][order] - z[j][order].max())
      p /= p.sum()
      kept = order[(np.cumsum(p) - p) < 0.9]
      pk = np.exp(z[j][kept] - z[j][kept].max())
      pk /= pk.sum()
      assert t in kept
      np.testing.assert_allclose(once.logprobs[row, j], np.log(pk[list(kept).index(t)]),
                                 atol=1e-5)


def test_a_slice_with_its_first_index_samples_the_rows_of_the_whole_batch(hf):
  """A batch split across processes: each slice, called with its offset, reproduces its rows."""
  _, cfg, params = hf["llama"]
  kw = dict(n=3, max_new_tokens=MAX_NEW, temperature=1.0, seed=5, max_slots=4)  # the programs
  # of test_logprobs_equal_teacher_forcing_and_no_recompile: nothing new compiles
  whole = rollout.generate(cfg, params, PROMPTS, **kw)
  cut = len(PROMPTS) // 2
  head = rollout.generate(cfg, params, PROMPTS[:cut], **kw)
  tail = rollout.generate(cfg, params, PROMPTS[cut:], first_index=cut, **kw)
  np.testing.assert_array_equal(np.concatenate([head.tokens, tail.tokens]), whole.tokens)
  np.testing.assert_allclose(np.concatenate([head.logprobs, tail.logprobs]), whole.logprobs,
                             atol=1e-6)
  shifted = rollout.generate(cfg, params, PROMPTS[cut:], **kw)  # without the offset: others
  assert not np.array_equal(shifted.tokens, tail.tokens)


def test_eos_and_stop_sequences(hf):
  _, cfg, params = hf["llama"]
  full = rollout.generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0)
  ref = full.tokens[1].tolist()
  eos = ref[3]
  out = rollout.generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0,
                         eos_id=eos)
  first = ref.index(eos)
  assert out.finish_reason[1] == "eos" and out.lengths[1] == first + 1
  assert out.mask[1].tolist() == [j <= first for j in range(MAX_NEW)]
  np.testing.assert_array_equal(out.tokens[1, :first + 1], ref[:first + 1])
  np.testing.assert_array_equal(out.tokens[1, first + 1:], 0)
  for row in (0, 2):  # rows without that token run to the budget
    if eos not in full.tokens[row]:
      assert out.finish_reason[row] == "length"
  stop = ref[4:6]
  out = rollout.generate(cfg, params, PROMPTS, max_new_tokens=MAX_NEW, temperature=0.0,
                         stop=[[cfg.vocab_size - 1, 0, 0], stop])
  end = next(j for j in range(1, MAX_NEW) if ref[j - 1:j + 1] == stop)
  assert out.finish_reason[1] == "stop" and out.lengths[1] == end + 1
  np.testing.assert_array_equal(out.tokens[1, :end + 1], ref[:end + 1])


def test_mesh_8_devices_equals_1(hf):
  _, cfg, params = hf["llama"]
  kw = dict(n=3, max_new_tokens=MAX_NEW, temperature=0.8, seed=1)
  ref = rollout.generate(cfg, params, PROMPTS, **kw)
  mesh = sharding.make_mesh({"data": 2, "sequence": 2, "tensor": 2})
  out = rollout.generate(cfg, params, PROMPTS, mesh=mesh, rules="fsdp_tp", **kw)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-5)
  # trainer weights laid out for another mesh (FSDP over 8) are resharded for the sampler's
  train_mesh = sharding.make_mesh({"fsdp": 8})
  trained = jax.device_put(params, models.param_shardings(cfg, train_mesh,
                                                          sharding.get_rules("fsdp")))
  moved = rollout.generate(cfg, trained, PROMPTS, mesh=mesh, rules="fsdp_tp", **kw)
  np.testing.assert_array_equal(moved.tokens, ref.tokens)
  # the cache really is laid out over the mesh: slots over data, length over sequence
  state = sampler.init_state(cfg, 4, 3, 8, 8, ctx=(mesh, sharding.get_rules("fsdp_tp")))
  spec = state.prefix_v[0].sharding.spec  # values [G,K,P,H]
  assert spec[0] == "data" and spec[1] == "tensor" and spec[2] == "sequence"
  spec = state.prefix_k[0].sharding.spec  # keys [G,K,H,P]: length last
  assert spec[0] == "data" and spec[1] == "tensor" and spec[2] is None and spec[3] == "sequence"


def test_bad_inputs_raise_one_clear_error(hf):
  _, cfg, params = hf["llama"]
  gen = lambda prompts, **kw: rollout.generate(cfg, params, prompts, max_new_tokens=4, **kw)
  with pytest.raises(rollout.RolloutError, match="prompt 1 is empty"):
    gen([[1, 2], []])
  with pytest.raises(rollout.RolloutError, match="exceeds the context"):
    gen([[1] * cfg.max_position_embeddings])
  with pytest.raises(rollout.RolloutError, match="n must be an integer >= 1"):
    gen([[1]], n=0)
  with pytest.raises(rollout.RolloutError, match="stop sequence 0 has token id"):
    gen([[1]], stop=[[cfg.vocab_size]])
  with pytest.raises(rollout.RolloutError, match="eos_id has token id"):
    gen([[1]], eos_id=-3)
  with pytest.raises(rollout.RolloutError, match="outside the vocabulary"):
    gen([[1, cfg.vocab_size + 5]])
  with pytest.raises(rollout.RolloutError, match="prompts is empty"):
    gen([])
  with pytest.raises(rollout.RolloutError, match="top_p"):
    gen([[1]], top_p=0.0)
  with pytest.raises(ValueError, match="temperature"):
    gen([[1]], temperature=-1.0)
  # token ids must be integers: a fractional or non-finite one is not rounded or truncated
  with pytest.raises(rollout.RolloutError, match="prompt 0 has token id 1.5, which is not an"):
    gen([[1.5, 2]])
  with pytest.raises(rollout.RolloutError, match="prompt 0 has token id nan"):
    gen([np.array([np.nan])])
  with pytest.raises(rollout.RolloutError, match="prompt 0 must be a sequence of integer"):
    gen([[True, False]])
  with pytest.raises(rollout.RolloutError, match="prefix 0 has token id 2.5"):
    gen([[1]], prefixes=[[2.5]])
  with pytest.raises(rollout.RolloutError, match="stop must be a list of stop sequences"):
    gen([[1]], stop=5)
  with pytest.raises(rollout.RolloutError, match="seed must be an integer"):
    gen([[1]], seed="7")
  # whole-valued floats and arrays of ids are ids: the same tokens as Python ints (at the
  # shapes of test_logprobs_equal_teacher_forcing_and_no_recompile: nothing new compiles)
  same = dict(n=3, max_new_tokens=MAX_NEW, max_slots=4)
  ref = rollout.generate(cfg, params, [[1, 2, 3]], seed=4, **same)
  np.testing.assert_array_equal(
      rollout.generate(cfg, params, [np.array([1.0, 2.0, 3.0])], seed=np.int64(4), **same).tokens,
      ref.tokens)


def test_prefill_attention_is_the_kernel_reference_computation():
  """Prefill of resumed responses (own causal block + the slot's prompt) and the training
  reference compute the same two-region log-sum-exp attention (layouts differ only in
  float32 summation order)."""
  import pallas_kernels
  rng = np.random.default_rng(0)
  G, M, R, N, K, H, P = 2, 3, 6, 4, 2, 8, 5
  normal = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
  q, k_resp, v_resp = normal(G, M, R, N, H), normal(G, M, R, K, H), normal(G, M, R, K, H)
  k_ctx, v_ctx = normal(G, P, K, H), normal(G, P, K, H)
  lengths = jnp.array([5, 2], jnp.int32)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((R, R), bool)), (G, M, R, R))
  valid = jnp.arange(P)[None, :] < lengths[:, None]
  got = sampler.grouped_attention(q, k_resp, v_resp, causal, prefix=(k_ctx, v_ctx, valid))
  ref = pallas_kernels.shared_prefix_attention_reference(q, k_ctx, v_ctx, k_resp, v_resp,
                                                         lengths)
  chex.assert_trees_all_equal_shapes_and_dtypes(got, ref)
  np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-6)


def test_decode_attention_with_length_last_keys_equals_plain_attention():
  """The decode query over the cache layouts (keys length-last [G,K,H,P] / [G,M,K,H,R],
  values [G,K,P,H] / [G,M,K,R,H]) equals float64 softmax attention over the prompt's valid
  keys then the sample's valid suffix keys, for single-slot groups (M = 1, as with distinct
  prompts) and shared prompts (M > 1)."""
  rng = np.random.default_rng(1)
  for G, M, P, R in [(3, 1, 5, 7), (2, 4, 6, 9)]:
    N, K, H = 4, 2, 8
    q = rng.standard_normal((G, M, N, H))
    pk, pv = rng.standard_normal((G, K, P, H)), rng.standard_normal((G, K, P, H))
    sk, sv = rng.standard_normal((G, M, K, R, H)), rng.standard_normal((G, M, K, R, H))
    plen = rng.integers(1, P + 1, G)
    slen = rng.integers(1, R + 1, (G, M))
    pvalid = np.arange(P)[None, :] < plen[:, None]
    svalid = np.arange(R)[None, None, :] < slen[..., None]
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    got = sampler.decode_attention(f32(q), f32(np.swapaxes(pk, -1, -2)), f32(pv),
                                   jnp.asarray(pvalid), f32(np.swapaxes(sk, -1, -2)), f32(sv),
                                   jnp.asarray(svalid))
    want = np.zeros((G, M, N, H))
    for g in range(G):
      for m in range(M):
        for n in range(N):
          kv = n // (N // K)
          keys = np.concatenate([pk[g, kv, :plen[g]], sk[g, m, kv, :slen[g, m]]])
          vals = np.concatenate([pv[g, kv, :plen[g]], sv[g, m, kv, :slen[g, m]]])
          w = scipy.special.softmax(keys @ q[g, m, n] / np.sqrt(H))
          want[g, m, n] = w @ vals
    assert got.shape == (G, M, N, H) and got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
