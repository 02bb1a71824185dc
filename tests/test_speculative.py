"""SPEC-RL speculative rollouts: acceptance rule and residual draw on hand cases, and the
output distribution of a tiny model against plain sampling (chi-square)."""

import collections

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import models, rollout
from rl_jax.rollout import speculative as spec

V, EOS, R = 6, 5, 3
CFG = models.ModelConfig(vocab_size=V, hidden_size=16, intermediate_size=32, num_layers=1,
                         num_heads=2, num_kv_heads=1, head_dim=8, max_position_embeddings=16)
PROMPT = [1, 2, 3]


def test_accept_lengths_hand_case():
  lp_new = np.log([[0.5, 0.2, 0.9], [0.1, 0.1, 0.1], [0.3, 0.3, 0.3]])
  lp_old = np.log([[0.25, 0.4, 0.9], [0.2, 0.1, 0.1], [0.3, 0.3, 0.3]])
  u = np.array([[0.99, 0.49, 0.5], [0.51, 0.0, 0.0], [0.9, 0.9, 0.9]])
  # row 0: ratio 2 -> accept; ratio 0.5, u 0.49 -> accept; ratio 1 -> accept: all 3
  # row 1: ratio 0.5, u 0.51 -> reject at 0. row 2: draft of length 2, all accepted.
  np.testing.assert_array_equal(spec.accept_lengths(lp_new, lp_old, [3, 3, 2], u), [3, 0, 2])
  u[0, 1] = 0.51  # now ratio 0.5 < u: rejected at 1
  np.testing.assert_array_equal(spec.accept_lengths(lp_new, lp_old, [3, 3, 2], u), [1, 0, 2])
  # lenience e^l = 2 turns ratio 0.5 into 1: accepted
  np.testing.assert_array_equal(
      spec.accept_lengths(lp_new, lp_old, [3, 3, 2], u, lenience=np.log(2.0)), [3, 3, 2])


def test_residual_token_hand_case():
  p = np.log([0.5, 0.3, 0.2, 1e-30])
  q = np.log([0.6, 0.1, 0.1, 0.2])
  # max(0, p - q) = [0, 0.2, 0.1, 0] -> norm [0, 2/3, 1/3, 0]
  assert spec.residual_token(p, q, 0.0) == 1
  assert spec.residual_token(p, q, 0.66) == 1
  assert spec.residual_token(p, q, 0.67) == 2
  assert spec.residual_token(p, q, 0.999999) == 2
  draws = [spec.residual_token(p, q, u) for u in np.random.default_rng(0).random(3000)]
  assert abs(np.mean(np.asarray(draws) == 1) - 2 / 3) < 0.03


def _gen(params, n, seed, **kw):
  return rollout.generate(CFG, params, [PROMPT], n=n, max_new_tokens=R, temperature=1.0,
                          eos_id=EOS, seed=seed, **kw)


def _rows(params, tokens):
  pt = jnp.asarray([PROMPT + [0]], jnp.int32)
  pl = jnp.asarray([len(PROMPT)], jnp.int32)
  return np.asarray(spec.sampling_logprobs(CFG, params, pt, pl,
                                           jnp.asarray(tokens)[None], 1.0, 0, 1.0))[0]


def _histogram(tokens, mask):
  return collections.Counter(tuple(int(t) for t, m in zip(row, mr) if m)
                             for row, mr in zip(tokens, mask))


def _chi2_pvalue(a: collections.Counter, b: collections.Counter) -> float:
  """Two-sample chi-square test of equal distributions (categories with >= 5 expected)."""
  keys = sorted(set(a) | set(b))
  na, nb = sum(a.values()), sum(b.values())
  ka, kb = np.asarray([a[k] for k in keys], float), np.asarray([b[k] for k in keys], float)
  tot = ka + kb
  big = tot * min(na, nb) / (na + nb) >= 5  # pool rare categories into one
  ka = np.append(ka[big], ka[~big].sum())
  kb = np.append(kb[big], kb[~big].sum())
  tot = ka + kb
  keep = tot > 0
  ka, kb, tot = ka[keep], kb[keep], tot[keep]
  ea, eb = tot * na / (na + nb), tot * nb / (na + nb)
  stat = np.sum((ka - ea) ** 2 / ea + (kb - eb) ** 2 / eb)
  return float(jax.scipy.stats.chi2.sf(stat, len(tot) - 1))


def test_speculative_output_matches_plain_sampling():
  """Drafts from an old policy q, verified by a different policy p: the responses are
  distributed as p's own samples; cutting at the rejection and resampling that position from
  p (no residual) is visibly not."""
  N = 4000
  old = models.init_params(CFG, jax.random.key(1), std=0.6)
  new = models.init_params(CFG, jax.random.key(2), std=0.6)
  drafts = _gen(old, N, seed=11)
  lengths = drafts.mask.sum(axis=1)
  q_rows, p_rows = _rows(old, drafts.tokens), _rows(new, drafts.tokens)
  np.testing.assert_allclose(  # the stored rows are the sampler's distributions
      np.take_along_axis(q_rows, drafts.tokens[..., None], -1)[..., 0][drafts.mask],
      drafts.logprobs[drafts.mask], atol=1e-4)
  sp = spec.speculate(drafts.tokens, lengths, p_rows, q_rows, np.random.default_rng(5),
                      eos_ids=[EOS], max_new_tokens=R)
  assert 0 < np.mean(sp.accepted == lengths) < 1  # some drafts kept whole, some cut
  kw = dict(n=N, max_new_tokens=R, temperature=1.0, top_p=1.0, top_k=0, eos_id=EOS)
  out = spec.complete_prefixes(CFG, new, [PROMPT], sp, seed=12, **kw)
  plain = _gen(new, N, seed=13)
  # behaviour log-probs of every token are the current policy's
  np.testing.assert_allclose(np.take_along_axis(_rows(new, out.tokens), out.tokens[..., None],
                                                -1)[..., 0][out.mask], out.logprobs[out.mask],
                             atol=1e-4)
  p_exact = _chi2_pvalue(_histogram(out.tokens, out.mask), _histogram(plain.tokens, plain.mask))
  assert p_exact > 1e-3, p_exact
  naive = spec.Speculation([t[:k] for t, k in zip(sp.tokens, sp.accepted)],
                           [lp[:k] for lp, k in zip(sp.logprobs, sp.accepted)],
                           [f if k == L else None for f, k, L in
                            zip(sp.finished, sp.accepted, lengths)], sp.accepted)
  cut = spec.complete_prefixes(CFG, new, [PROMPT], naive, seed=12, **kw)
  p_naive = _chi2_pvalue(_histogram(cut.tokens, cut.mask), _histogram(plain.tokens, plain.mask))
  assert p_naive < 1e-3, p_naive


def test_continuations_with_the_prompt_on_pages_draw_the_same_tokens(monkeypatch):
  """``complete_prefixes(prompt_pages=True)``: each row's prompt ids and accepted prefix on
  pool pages (rebuilt once per group, forked where rows agree) draw the tokens, ends and
  log-probs (to float rounding) of the prompt in the slot, for prefixes of every length
  (none, cut at a rejection, a whole finished draft), over several prompts."""
  old = models.init_params(CFG, jax.random.key(1), std=0.6)
  new = models.init_params(CFG, jax.random.key(2), std=0.6)
  prompts = [PROMPT, [4, 1, 2, 3, 1, 4, 2], [2, 2]]
  n = 16
  drafts = rollout.generate(CFG, old, prompts, n=n, max_new_tokens=R, temperature=1.0,
                            eos_id=EOS, seed=11)
  lengths = drafts.mask.sum(axis=1)
  pt = jnp.asarray([p + [0] * (8 - len(p)) for p in prompts], jnp.int32)
  pl = jnp.asarray([len(p) for p in prompts], jnp.int32)
  rows = lambda params: np.asarray(spec.sampling_logprobs(
      CFG, params, pt, pl, jnp.asarray(drafts.tokens).reshape(len(prompts), n, R), 1.0, 0,
      1.0)).reshape(len(prompts) * n, R, V)
  sp = spec.speculate(drafts.tokens, lengths, rows(new), rows(old), np.random.default_rng(5),
                      eos_ids=[EOS], max_new_tokens=R)
  assert (sp.accepted == 0).any() and (sp.accepted == lengths).any()
  assert ((sp.accepted > 0) & (sp.accepted < lengths)).any()
  kw = dict(n=n, max_new_tokens=R, temperature=1.0, top_p=1.0, top_k=0, eos_id=EOS, seed=12)
  engines = []
  monkeypatch.setattr(spec, "RolloutEngine", lambda *a, **k: engines.append(
      rollout.RolloutEngine(*a, **k)) or engines[-1])
  slot = spec.complete_prefixes(CFG, new, prompts, sp, **kw)
  paged = spec.complete_prefixes(CFG, new, prompts, sp, prompt_pages=True, **kw)
  assert [e.prompt_pages for e in engines] == [False, True]
  np.testing.assert_array_equal(paged.tokens, slot.tokens)
  np.testing.assert_array_equal(paged.mask, slot.mask)
  np.testing.assert_array_equal(paged.finish_reason, slot.finish_reason)
  np.testing.assert_allclose(paged.logprobs, slot.logprobs, atol=1e-5, rtol=0)
