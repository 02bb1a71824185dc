"""Mixture-of-experts RL: the sampler's expert records, router replay in the grouped
log-prob passes, the routing-mismatch metric and the load-balancing loss of the updates."""

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rl_jax import config as config_lib
from rl_jax import config_utils, losses, models, rollout, train
from rl_jax.errors import ConfigError
from rl_jax.train import queue
from rl_jax.train.steps import routing_mismatch
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL

MOE_QUICKSTART = os.path.join(ROOT, "configs", "moe_quickstart.py")

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
  # the prompts on pages of 2 (``prompt_pages``): the records of the response's tokens, cut
  # from those of the prompt's ids the decode feeds
  paged = rollout.generate(CFG, params, PROMPTS, n=2, max_new_tokens=6, temperature=1.0,
                           seed=3, page_size=2, prompt_pages=True)
  np.testing.assert_array_equal(paged.tokens, out.tokens)
  np.testing.assert_array_equal(np.sort(paged.routing, -1), np.sort(out.routing, -1))


def test_held_groups_keep_their_expert_records_through_export_and_import(sampled):
  """APRIL on a MoE model: ``export_held`` writes each held sample's expert records, an
  engine rebuilt by ``import_held`` holds the same records and continues exactly like the
  original (tokens and routing), and a resumed group's tokens and routing are those of an
  uninterrupted pass (the records of the tokens fed before the abort come from the held
  group)."""
  params, _ = sampled
  eos = list(range(3, 31, 6))  # 5 EOS ids: lengths spread over 1..8
  prompts = [rollout.Prompt(PROMPTS[i % 3] + [i % 29 + 1], meta=i) for i in range(24)]
  make = lambda: rollout.RolloutEngine(CFG, n=2, max_slots=2, max_new_tokens=8,
                                       max_prompt_len=8, temperature=1.0, eos_id=eos, seed=2,
                                       max_staleness=2)
  a, pulled = make(), [0]

  def counting():
    for p in prompts:
      pulled[0] += 1
      yield p

  it_a = counting()
  for step in range(3):
    a.rollout_groups(params, it_a, k_groups=1, policy_version=step)
  partial = [s for r in a.buffer for s in r.samples if s.tokens and s.finish_reason is None]
  assert partial, "no partial sample held; the test would not exercise the round trip"
  held = a.export_held(capacity=4)
  assert held["routing"].shape == (4, 2, 8, 2, 2)
  reqs = list(a.ready) + list(a.buffer)
  for h, req in enumerate(reqs):
    for i, smp in enumerate(req.samples):
      t = len(smp.tokens)
      np.testing.assert_array_equal(held["routing"][h, i, :t], smp.routing)
      assert (held["routing"][h, i, t:] == -1).all()
  assert (held["routing"][held["valid"]] >= 0).any()
  b = make()
  b.import_held(held)
  for ra, rb in zip(reqs, list(b.ready) + list(b.buffer)):
    for sa, sb in zip(ra.samples, rb.samples):
      np.testing.assert_array_equal(sb.routing, sa.routing)
  it_b = iter(prompts[pulled[0]:])
  outs = []
  for step in range(3, 6):
    out_a = a.rollout_groups(params, it_a, k_groups=1, policy_version=step)
    out_b = b.rollout_groups(params, it_b, k_groups=1, policy_version=step)
    np.testing.assert_array_equal(out_a.group_ids, out_b.group_ids)
    np.testing.assert_array_equal(out_a.tokens, out_b.tokens)
    np.testing.assert_array_equal(out_a.routing, out_b.routing)
    outs.append(out_a)
  assert sum(o.stats["resumed_groups"] for o in outs) > 0, "no held group was resumed"
  # fixed weights: a resumed group's tokens and expert records are those of one
  # uninterrupted pass of its prompt (uid u is prompt u; one group alone in the slots is
  # admitted by the programs the engines above compiled)
  c = make()
  for out in outs:
    uid = int(out.group_ids[0])
    (done,), _ = c.run(params, [rollout.GroupRequest(
        uid, prompts[uid].tokens, [rollout.Sample(), rollout.Sample()])])
    ref = rollout.assemble([done], 8)
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    np.testing.assert_array_equal(out.routing, ref.routing)
    for r in range(2):  # every fed token has its experts; the last one is never fed
      n = int(out.lengths[r])
      assert (out.routing[r, :n - 1] >= 0).all() and (out.routing[r, n - 1:] == -1).all()


def test_replayed_logprobs_equal_the_forward_with_that_routing(sampled):
  """``response_logprobs(routing=)`` (packed and replicated layouts) == log-softmax of
  ``models.forward(routing=)`` on the prompt + response rows, with the router's own experts
  for the prompt tokens and for a token without a record."""
  params, _ = sampled
  rng = np.random.default_rng(1)
  G, M, R, P = 2, 2, 4, 6
  lengths = np.asarray([6, 3], np.int32)
  prompts = rng.integers(1, 31, (G, P)).astype(np.int32)
  tokens = rng.integers(1, 31, (G, M, R)).astype(np.int32)
  # a routing the router would not choose: two distinct random experts per token and layer
  given = np.argsort(rng.random((G, M, R, 2, 8)), axis=-1)[..., :2].astype(np.int32)
  given[1, 0, 2] = -1  # no record for this token: the router decides
  lp = jax.jit(lambda p, r: [models.response_logprobs(
      CFG, p, prompts, lengths, tokens, shared_prefix=shared, routing=r)
      for shared in (True, False)])
  packed, replicated = map(np.asarray, lp(params, given))
  # the plain forward over right-padded rows prompt_g[:len_g] + response (causal: the
  # padding changes nothing before it)
  rows = [list(prompts[g, :lengths[g]]) + list(tokens[g, i]) for g in range(G) for i in range(M)]
  seq = jnp.asarray([r + [0] * (P + R - len(r)) for r in rows])
  fwd = jax.jit(lambda p, r: models.forward(CFG, p, seq, routing=r, return_routing=True))
  own_logits, own = fwd(params, jnp.full((2, G * M, P + R, 2), -1, jnp.int32))
  route = np.array(own.ids)  # the router's own experts (prompt, unrecorded token)
  for b in range(G * M):
    n = int(lengths[b // M])
    route[:, b, n:n + R] = np.moveaxis(given[b // M, b % M], 1, 0)  # -1: the router's
  logits, _ = fwd(params, jnp.asarray(route))
  logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
  own_logp = np.asarray(jax.nn.log_softmax(own_logits, axis=-1))
  assert np.abs(logp - own_logp).max() > 1e-3  # the replayed routing matters
  for b in range(G * M):
    n = int(lengths[b // M])
    want = np.take_along_axis(logp[b, n - 1:n + R - 1], tokens[b // M, b % M][:, None], -1)
    np.testing.assert_allclose(packed[b // M, b % M], want[:, 0], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(replicated[b // M, b % M], want[:, 0], atol=2e-5, rtol=1e-5)


def test_routing_mismatch_counts_tokens_whose_expert_set_differs():
  rec = np.asarray([[[[[0, 1]], [[2, 3]], [[4, 5]], [[-1, -1]]]]], np.int32)  # [1,1,4,Y=1,2]
  used = np.asarray([[[[[1, 0]], [[2, 4]], [[4, 5]], [[6, 7]]]]], np.int32)
  mask = np.asarray([[[True, True, False, True]]])
  # counted: tokens 0, 1 (token 2 masked, token 3 unrecorded); token 1 differs
  assert float(routing_mismatch(jnp.asarray(used), jnp.asarray(rec),
                                      jnp.asarray(mask))) == 0.5


REPLAY = list(TINY_MODEL) + [
    "model.num_experts=4", "model.moe_intermediate_size=16", "model.router_replay=True",
    "sft.steps=0", "train.steps=1", "train.batch_groups=2", "rollout.n=2",
    "rollout.max_new_tokens=2", "train.eval_every=0", "log.tensorboard=False",
    "rollout.temperature=1.0"]


def _replay_step(extra=()):
  s = train.build_setup(config_utils.load_config(MOE_QUICKSTART, REPLAY + list(extra)))
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  new_state, record, _ = train.rl_step(t, state)
  return s, record, new_state


@pytest.fixture(scope="module")
def replay_run():
  """One synchronous RL step of a one-layer MoE policy with router replay (float32)."""
  return _replay_step()


def test_micro_batches_take_each_groups_expert_records_along(replay_run):
  """``train.micro_batches=2`` (one group each) with router replay: the old-log-prob pass and
  the update replay each group's records in its micro-batch: no mismatch, ratios 1, and the
  whole batch's step (loss, updated weights) to float rounding."""
  _, whole, whole_state = replay_run
  s, record, state = _replay_step(["train.micro_batches=2"])
  assert s.train.old_logp_pass == "separate"  # the pass with the records runs
  assert record["routing_mismatch"] == 0.0
  assert record["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
  assert record["loss"] == pytest.approx(whole["loss"], rel=1e-5, abs=1e-7)
  lr = float(s.optim.lr)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, atol=lr / 4),
               jax.device_get(state.params), jax.device_get(whole_state.params))


def test_router_replay_step_has_no_routing_mismatch(replay_run):
  s, record, _ = replay_run
  assert s.model_cfg.is_moe and s.model_cfg.sparse_layers == (True,)
  assert record["routing_mismatch"] == 0.0
  # the proximal pass replays the same routing as the update: ratios are exactly 1
  assert record["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_queue_keeps_the_expert_records_of_moe_models(replay_run):
  s, _, _ = replay_run
  s = dataclasses.replace(s, train=dataclasses.replace(s.train, mode="async", async_lag=1))
  assert s.schedule.queue == 1  # derived again from the replaced settings
  assert "routing" not in queue.empty_queue(1, s.geometry, s.prompt_len)  # no model config
  empty = queue.setup_queue(s)
  R, Y, X = s.rollout.max_new_tokens, 1, 2
  assert empty["routing"].shape == (1, 4, R, Y, X)
  rng = np.random.default_rng(0)
  item = train.Scored(
      indices=np.arange(2, dtype=np.int32), prompts=np.ones((2, s.prompt_len), np.int32),
      prompt_lens=np.ones(2, np.int32), tokens=np.ones((4, R), np.int32),
      mask=np.ones((4, R), bool), logprobs=np.zeros((4, R), np.float32),
      versions=np.zeros((4, R), np.int32), rewards=np.zeros((2, 2), np.float32),
      faults=np.zeros(2, np.int64), rollout_s=1.0, version=0, stats={},
      routing=rng.integers(-1, 4, (4, R, Y, X)).astype(np.int32))
  (back,) = queue.from_arrays(queue.to_arrays(empty, [item]))
  np.testing.assert_array_equal(back["routing"], item.routing)


@pytest.mark.parametrize("override,field", [
    ("model.router=grouped_topk", "model.router"),
    ("model.attention=chunked", "model.attention"),
    ("model.num_experts=0", "model.num_experts"),
    ("model.architecture=qwen3", "model.num_experts"),
    ("model.num_experts_per_tok=9", "model.num_experts_per_tok"),
    ("model.router_aux_loss_coef=-0.1", "model.router_aux_loss_coef"),
])
def test_bad_moe_configs_fail_in_one_line(override, field):
  config = config_utils.load_config(MOE_QUICKSTART, [override])
  with pytest.raises(ConfigError, match=field.replace(".", r"\.")) as e:
    config_lib.validate(config)
  assert "\n" not in str(e.value)


def test_sliding_attention_and_replay_need_their_families():
  config = config_utils.load_config(QUICKSTART, ["model.attention=sliding"])
  with pytest.raises(ConfigError, match=r"model\.attention='sliding' needs"):
    config_lib.validate(config)
  config = config_utils.load_config(QUICKSTART, ["model.router_replay=True"])
  with pytest.raises(ConfigError, match=r"model\.router_replay=True needs"):
    config_lib.validate(config)
  config = config_utils.load_config(QUICKSTART, ["model.router_aux_loss_coef=0.01"])
  with pytest.raises(ConfigError, match=r"model\.router_aux_loss_coef=0\.01 needs") as e:
    config_lib.validate(config)
  assert "\n" not in str(e.value)



@pytest.mark.parametrize("field", ["router_replay=True", "router_aux_loss_coef=0.01",
                                   "moe_capacity_factor=1.5"])
def test_moe_fields_on_a_dense_checkpoint_fail_at_setup(tmp_path, field):
  """With ``model.hf_path`` the checkpoint's ``config.json`` names the architecture, so the
  mixture-of-experts fields are checked against it when the setup reads it: one line."""
  from tests.hf_utils import tiny_hf_model  # pylint: disable=import-outside-toplevel
  tiny_hf_model("qwen3", tmp_path, vocab=256)
  config = config_utils.load_config(QUICKSTART, [f"model.hf_path={tmp_path}",
                                                 "data.tokenizer=char", f"model.{field}"])
  config_lib.validate(config)  # the config alone cannot tell
  with pytest.raises(ConfigError, match=rf"model\.{field.split('=')[0]}=.* needs a "
                     r"mixture-of-experts model .*got 'qwen3'") as e:
    train.build_setup(config)
  assert "\n" not in str(e.value)


# ------------------------------------------------------------------ load-balancing loss
def _aux_setup(coef):
  """Two MoE layers (4 experts, top 2), router replay, one device; ``coef``: the
  load-balancing loss weight."""
  config = config_utils.load_config(MOE_QUICKSTART, list(TINY_MODEL) + [
      "model.num_layers=2", "model.num_experts=4", "model.moe_intermediate_size=16",
      "model.router_replay=True", f"model.router_aux_loss_coef={coef}", "mesh.num_devices=1",
      "sft.steps=1", "sft.batch_size=4", "train.batch_groups=2", "rollout.n=2",
      "rollout.max_new_tokens=4", "train.eval_every=0", "log.tensorboard=False"])
  return train.build_setup(config)


def _hf_aux_and_grad(logits, mask):
  """transformers' ``load_balancing_loss_func`` of router logits [Y,B,T,E] over the tokens
  of ``mask`` [B,T], and its gradient with respect to the logits (torch autograd)."""
  Y, _, _, E = logits.shape
  t = torch.tensor(np.asarray(logits), requires_grad=True)
  loss = load_balancing_loss_func(tuple(t[y].reshape(-1, E) for y in range(Y)), E, 2,
                                  torch.tensor(np.asarray(mask, bool)))
  loss.backward()
  return loss.item(), jnp.asarray(t.grad.numpy())


def test_load_balancing_loss_term_of_the_updates():
  """``model.router_aux_loss_coef`` = c with router replay: the RL update's loss is the
  objective's plus c × transformers' load-balancing loss of the current router over the
  valid prompt tokens and the generated tokens of the G·M sequences, and its gradient (every
  weight, the routers included) adds c × that loss's gradient, pulled back through a plain
  forward with the same replayed experts; metric ``moe_aux_loss``. c = 0: no term, no
  metric. The supervised step adds the loss over its valid tokens (same metric)."""
  c = 0.5
  s0, s1 = _aux_setup(0.0), _aux_setup(c)
  cfg = s1.model_cfg
  G, M, R, P, Y, X, E = 2, 2, 4, s1.prompt_len, 2, 2, 4
  rng = np.random.default_rng(0)
  lengths = np.asarray([P, 3], np.int32)
  prompts = rng.integers(3, 20, (G, P)).astype(np.int32)
  tokens = rng.integers(3, 20, (G, M, R)).astype(np.int32)
  generated = np.ones((G, M, R), bool)
  generated[0, 1, 2:] = generated[1, 0, 3:] = False  # finished early: padding
  mask = generated.copy()
  mask[1, 1, 0] = False  # generated but not in the loss (e.g. a stale token): still routed
  routing = np.argsort(rng.random((G, M, R, Y, E)), axis=-1)[..., :X].astype(np.int32)
  routing[1, 1, 2] = -1  # no record: the router's own experts
  inputs = losses.ObjectiveInputs(
      rewards=rng.random((G, M)).astype(np.float32), mask=mask, generated_mask=generated,
      old_logp=np.full((G, M, R), -2.0, np.float32),
      behaviour_logp=np.full((G, M, R), -2.0, np.float32))
  batch = train.UpdateBatch(prompts, lengths, tokens, inputs,
                            losses.Advantages(rng.normal(size=(G, M)).astype(np.float32)),
                            routing)
  # random weights (std 0.3, unit norms) drawn in numpy: quicker here than init_params
  params = jax.tree_util.tree_map_with_path(
      lambda path, a: jnp.asarray(np.ones(a.shape, np.float32) if "norm" in jax.tree_util.keystr(
          path) else 0.3 * rng.normal(size=a.shape).astype(np.float32)),
      jax.eval_shape(lambda: models.init_params(cfg, jax.random.key(0))))
  loss0, _, mets0, g0, _ = jax.jit(train.rl_grads(s0))(params, {}, batch)
  loss1, _, mets1, g1, _ = jax.jit(train.rl_grads(s1))(params, {}, batch)

  # the G·M sequences prompt_g[:len_g] + response, right-padded (causal: padding changes
  # nothing before it), routed as the update routes them
  rows = [list(prompts[g, :lengths[g]]) + list(tokens[g, i]) for g in range(G) for i in range(M)]
  seq = jnp.asarray([r + [0] * (P + R - len(r)) for r in rows])
  route = np.full((Y, G * M, P + R, X), -1, np.int32)
  real = np.zeros((G * M, P + R), bool)
  for b in range(G * M):
    n = int(lengths[b // M])
    route[:, b, n:n + R] = np.moveaxis(routing[b // M, b % M], 1, 0)
    real[b, :n] = True
    real[b, n:n + R] = generated[b // M, b % M]
  router_logits = lambda p: models.forward(cfg, p, seq, routing=jnp.asarray(route),
                                           return_routing=True)[1].logits
  logits, pullback = jax.vjp(router_logits, params)
  aux, dlogits = _hf_aux_and_grad(logits, real)
  (g_aux,) = pullback(dlogits)

  assert "moe_aux_loss" not in mets0
  assert float(mets1["moe_aux_loss"]) == pytest.approx(aux, rel=1e-5)
  assert float(loss1) == pytest.approx(float(loss0) + c * aux, rel=1e-5)
  assert float(jnp.abs(g_aux["moe"]["router"]).max()) > 1e-3  # the term trains the routers
  jax.tree.map(lambda a, b, d: np.testing.assert_allclose(
      np.asarray(b) - np.asarray(a), c * np.asarray(d), rtol=1e-4, atol=1e-6), g0, g1, g_aux)

  # the supervised step: the next-token loss (metric sft_loss) plus c × the loss over its
  # valid tokens
  sft_tokens, attn, loss_mask = map(jnp.asarray, train.sft_batch(s1, s1.train_examples[:4]))
  ref = jax.jit(lambda p: (
      models.forward(cfg, p, sft_tokens, attention_mask=attn, return_routing=True)[1].logits,
      models.sequence_logprobs(cfg, p, sft_tokens, attention_mask=attn)))
  sft_logits, lp = ref(params)
  nll = -float(jnp.sum(lp * loss_mask) / jnp.sum(loss_mask))
  p = jax.tree.map(jnp.copy, params)  # the step donates its weights
  out = train.make_sft_step(s1, train.make_layout(s1))(
      p, s1.optimizers.sft.init(p), sft_tokens, attn, loss_mask)[2]
  assert float(out["sft_loss"]) == pytest.approx(nll, rel=1e-5)
  assert float(out["moe_aux_loss"]) == pytest.approx(
      _hf_aux_and_grad(sft_logits, attn)[0], rel=1e-5)


def test_lora_reference_pass_replays_the_expert_records():
  """LoRA on the attention of a MoE policy with router replay and a KL term: the reference
  pass (the base, adapters off, ``make_ref_logprob_fn``) takes the sampler's expert records
  like the policy's passes. It took one argument fewer, and the step failed before it ran
  (``in_shardings ... length 5 for an args tuple of length 6``)."""
  s, record, _ = _replay_step(["model.lora.rank=4", "model.lora.targets=q,k,v,o",
                               "loss.kl_beta=0.1"])
  assert s.model_cfg.lora_rank == 4 and "ref_logp" in s.objective.needs
  assert record["routing_mismatch"] == 0.0
  # the adapters start at zero: the policy is its base, so the k3 KL is 0
  assert record["kl"] == pytest.approx(0.0, abs=1e-6)
