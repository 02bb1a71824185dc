"""Multi-turn rollouts (``rollout.AgentEngine``): exact ids and log-probs, incremental prefill,
KV time-to-live eviction, environment failures and limits, continuous vs turn-synchronous,
a mixture-of-experts policy's expert records (router replay).

The environments and the chat format here are small deterministic test environments over
the character tokenizer (the engine takes any renderer with ``prompt_ids``, ``delta_ids`` and
``end_of_turn_ids``).
"""

import random
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import models, rollout, sharding
from rl_jax.data.tokenizers import CharTokenizer
from rl_jax.envs import Message, StepResult
from rl_jax.envs import base as env_base
from rl_jax.rollout import extend as ext_lib
from rl_jax.rollout import pages, sampler, slots
from rl_jax.rollout.engine import PAGE_STATS
from tests.test_paged_kv import _on_pages

TOK = CharTokenizer()
CFG = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=48,
                         num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                         max_position_embeddings=192, dtype="float32", param_dtype="float32")
PARAMS = models.init_params(CFG, jax.random.key(0), std=0.2)
# eos plus a dozen characters end a turn: turn lengths spread over the per-turn budget
STOP = [TOK.eos_id] + TOK.encode("aeiou.!?0123")


class ChatRenderer:
  """"<role>:<content>\\n" per message, then "A:" (the assistant's turn header)."""

  end_of_turn_ids = [TOK.eos_id]
  ROLE = {"system": "S", "user": "U", "tool": "T", "assistant": "A"}

  def _text(self, messages):
    return "".join(f"{self.ROLE[m.role]}:{m.content}\n" for m in messages)

  def prompt_ids(self, messages, tools=()):
    head = f"tools:{','.join(t.name for t in tools)}\n" if tools else ""
    return TOK.encode(head + self._text(messages) + "A:")

  def delta_ids(self, history, new):
    del history
    return TOK.encode("\n" + self._text(new) + "A:")


class CounterEnv:
  """Answers each turn with its length and a running count; reward = length mod 3. Optional
  per-step sleeps (``sleep``: fixed seconds, or "random" for 0-30 ms), a step that raises
  (``raise_at``), a step that hangs (``hang_at``), a step whose reward is NaN (``nan_at``)
  and long observations (``long``)."""

  tools = ()

  def __init__(self, sleep=0.0, raise_at=None, hang_at=None, long=False, turns=3, hang_s=1.0,
               nan_at=None):
    self.sleep, self.raise_at, self.hang_at, self.long, self.turns = (
        sleep, raise_at, hang_at, long, turns)
    self.hang_s, self.nan_at = hang_s, nan_at

  def reset(self, example, seed):
    self.k, self.seed = 0, seed
    self.turns = example.get("turns", self.turns)
    return [Message("system", "count"), Message("user", example["q"])]

  def step(self, action):
    self.k += 1
    time.sleep(random.uniform(0, 0.03) if self.sleep == "random" else self.sleep)
    if self.k == self.raise_at:
      raise ZeroDivisionError("division by zero")
    if self.k == self.hang_at:
      time.sleep(self.hang_s)
    text = f"n={self.k} len={len(action)} s={self.seed % 7}" + (" x" * 40 if self.long else "")
    reward = float("nan") if self.k == self.nan_at else float(len(action) % 3)
    return StepResult((Message("tool", text),), reward=reward, done=self.k >= self.turns,
                      info={"tool_calls": 1})


def _specs(k, **env):
  return [rollout.EpisodeSpec(lambda: CounterEnv(**env), {"q": f"q{i}"}, meta=i)
          for i in range(k)]


def _engine(detok=TOK.decode, **kw):
  args = dict(n=2, max_slots=2, max_prompt_len=24, max_total_tokens=96, max_turn_tokens=12,
              max_turns=3, max_obs_tokens=32, stop_ids=STOP, seed=3, ttl=None, workers=8)
  args.update(kw)
  return rollout.AgentEngine(CFG, ChatRenderer(), detok, **args)


_FORWARD = jax.jit(models.forward, static_argnums=0)


def _check_exact(out, temperature, cfg=CFG, params=PARAMS):
  """Recorded log-probs = log_softmax(logits / T) of one teacher-forced pass over
  prompt + trajectory, at the model tokens (rows right-padded to one length)."""
  B = len(out.lengths)
  seqs = [out.prompts[out.prompt_index[b]] + out.tokens[b, :out.lengths[b]].tolist()
          for b in range(B)]
  batch = np.zeros((B, 32 + out.tokens.shape[1]), np.int32)
  for b, seq in enumerate(seqs):
    batch[b, :len(seq)] = seq
  logp = np.asarray(jax.nn.log_softmax(_FORWARD(cfg, params, jnp.asarray(batch)) / temperature))
  for b, seq in enumerate(seqs):
    n, mask = int(out.lengths[b]), out.model_mask[b]
    p = len(seq) - n
    ref = np.asarray([logp[b, p + j - 1, seq[p + j]] for j in range(n)])
    np.testing.assert_allclose(out.logprobs[b, :n][mask[:n]], ref[mask[:n]], atol=1e-5)
    assert (out.logprobs[b][~mask] == 0).all() and (out.versions[b][~mask] == -1).all()


def _replay_observations(out, b, detok=TOK.decode):
  """Rebuild row b's environment by reset + replay of its actions; check every observation
  chunk is exactly the renderer's ``delta_ids`` and every action the decoded model turn."""
  r, eng_seed = ChatRenderer(), 3
  uid = int(out.group_ids[out.prompt_index[b]])
  env = CounterEnv()
  msgs = env.reset({"q": f"q{out.group_meta[out.prompt_index[b]]}"},
                   rollout.env_seed(eng_seed, uid, b % 2))
  assert r.prompt_ids(msgs) == out.prompts[out.prompt_index[b]]
  toks, mask, turn = out.tokens[b], out.model_mask[b], out.turn[b]
  start = 0
  for u, action in enumerate(out.actions[b]):
    end = int(out.turn_ends[b, u])
    model = toks[start:end]
    assert mask[start:end].all() and (turn[start:end] == u).all()
    body = model[:-1] if model[-1] in STOP else model
    assert detok(body.tolist()) == action
    msgs.append(Message("assistant", action))
    res = env.step(action)
    assert res.reward == out.turn_rewards[b, u]
    nxt = int(out.turn_ends[b, u + 1]) if u + 1 < out.num_turns[b] else None
    if nxt is not None:
      obs = r.delta_ids(msgs, res.messages)
      obs_start = nxt - int(np.argmax(~mask[:nxt][::-1]))  # end of the observation run
      assert toks[end:obs_start].tolist() == ([TOK.eos_id] if model[-1] not in STOP else []) + obs
      assert not mask[end:obs_start].any() and (turn[end:obs_start] == u).all()
      msgs.extend(res.messages)
      start = obs_start
  assert out.reward[b] == pytest.approx(out.turn_rewards[b].sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forcing_and_observations_are_delta_ids(temperature):
  eng = _engine(temperature=temperature)
  out = eng.rollout(PARAMS, _specs(3), policy_version=4)
  assert out.tokens.shape == (6, 128) and out.turn_rewards.shape == (6, 3)
  assert (out.num_turns >= 2).any() and out.model_mask.sum() > 0
  assert (out.versions[out.model_mask] == 4).all()
  _check_exact(out, temperature)
  for b in range(6):
    _replay_observations(out, b)
  assert (out.finish_reason == "done").all() and (out.tool_calls == out.num_turns).all()


class TwinTokenizer:
  """Decodes "b" as "a" too: decode -> encode is not the identity."""

  def decode(self, ids):
    return TOK.decode(ids).replace("b", "a")


def test_trained_ids_are_the_sampled_ids_with_a_lossy_tokenizer():
  twin = TwinTokenizer()
  out = _engine(detok=twin.decode, seed=3).rollout(PARAMS, _specs(4))
  b_id = TOK.encode("b")[0]
  assert (out.tokens[out.model_mask] == b_id).any(), "no 'b' sampled; pick another seed"
  assert not any("b" in a for acts in out.actions for a in acts)
  _check_exact(out, 1.0)  # log-probs of the sampled ids, not of a re-encoding
  for b in range(len(out.lengths)):
    _replay_observations(out, b, detok=twin.decode)


@pytest.mark.parametrize("page_size", [None, 8])
def test_incremental_prefill_equals_reprefill(page_size):
  """``extend``'s logits equal a full forward pass and the K/V it writes equals a re-prefill
  of the whole history (``resume``); with pages of 8 the chunks attend only the live-page
  bucket covering their trajectories (``live``: fewer than the table's 16 entries)."""
  G, M, P, R = 2, 2, 32, 128  # the engine tests' shapes: programs compile once
  sp, filt = rollout.records.sampling_params(CFG, 1.0, 0, 1.0, [TOK.eos_id] + STOP, None)
  key = jax.random.key(0, impl="threefry2x32")
  prompt = TOK.encode("U:hi\nA:")
  state = sampler.init_state(CFG, G, M, P, R, S=page_size)
  a = slots.admission_rows(G, 16, G=G, M=M, R=R, budget=6)
  a["slots"][0], a["prompt_len"][0], a["request_id"][0] = 0, len(prompt), 7
  a["prompt"][0, :len(prompt)], a["sample_id"][0] = prompt, [0, 1]
  state = sampler.admit(CFG, PARAMS, state, sampler.Admission(**a), sp, jnp.int32(0), key,
                        filtered=filt)
  state, _ = sampler.decode(CFG, PARAMS, state, sp, jnp.int32(0), jnp.int32(32),
                            sampler.NEVER, jnp.int32(8), filtered=filt)
  length = np.asarray(state.length[0])
  obs = [TOK.encode("\nT:n=1\nA:"), TOK.encode("\nT:x\nA:")]
  x = ext_lib.Extension(np.array([0, 0, G, G], np.int32), np.array([0, 1, 0, 0], np.int32),
                        (np.r_[length, 0, 0] - [1, 1, 0, 0]).astype(np.int32),
                        np.zeros((4, 32), np.int32), np.ones(4, np.int32),
                        np.full(4, R, np.int32))
  for m in range(M):
    x.tokens[m, 0], x.tokens[m, 1:1 + len(obs[m])] = state.tokens[0, m, length[m] - 1], obs[m]
    x.count[m] = 1 + len(obs[m])
  live = None
  if page_size:
    live = pages.live_bucket(int(x.start.max()), page_size, R // page_size, floor_tokens=1)
    assert live < R // page_size
  state, logits = ext_lib.extend(CFG, PARAMS, state, x, sp, jnp.int32(1), filtered=filt,
                                 live=live)
  # reference 1: a full forward pass (re-prefill of the whole history)
  # reference 2: the engine's re-prefill path (``resume``) of the same history into a fresh state
  fresh = sampler.init_state(CFG, G, M, P, R, S=page_size)
  fresh = sampler.admit(CFG, PARAMS, fresh, sampler.Admission(**a), sp, jnp.int32(0), key,
                        filtered=filt)
  res = slots.resume_rows(4, R // 4, G)
  for m in range(M):
    n = int(state.length[0, m])
    hist = np.asarray(state.tokens[0, m, :n])
    seq = np.zeros((1, P + R), np.int32)
    seq[0, :len(prompt) + n] = prompt + hist.tolist()
    full = _FORWARD(CFG, PARAMS, jnp.asarray(seq))[0]
    np.testing.assert_allclose(logits[m], full[len(prompt) + n - 2], atol=1e-5)
    assert n <= R // 4
    res.slot[m], res.sample[m], res.length[m], res.tokens[m, :n] = 0, m, n, hist
  fresh = sampler.resume(CFG, PARAMS, fresh, res)
  for m in range(M):
    n = int(state.length[0, m]) - 1  # cached positions (the last token is fed next)
    for x, y in zip(_on_pages(state, 0, m, n), _on_pages(fresh, 0, m, n)):
      np.testing.assert_allclose(x, y, atol=1e-5)


def _same(a, b):
  np.testing.assert_array_equal(a.tokens, b.tokens)
  np.testing.assert_array_equal(a.model_mask, b.model_mask)
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  np.testing.assert_array_equal(a.turn_ends, b.turn_ends)
  np.testing.assert_array_equal(a.turn_rewards, b.turn_rewards)
  assert a.actions == b.actions and list(a.finish_reason) == list(b.finish_reason)


def test_eviction_and_tool_timing_do_not_change_trajectories():
  base = _engine().rollout(PARAMS, _specs(5))
  assert base.stats["evictions"] == 0 and base.stats["kv_hit_rate"] == 1.0
  evict = _engine(ttl=0.0).rollout(PARAMS, _specs(5, sleep="random"))
  assert evict.stats["evictions"] > 0 and evict.stats["kv_hit_rate"] < 1.0
  assert evict.stats["reprefill_tokens"] > 0
  _same(base, evict)
  _check_exact(evict, 1.0)


@pytest.mark.parametrize("prompt_pages", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_multi_turn_on_8_devices_equals_1(prompt_pages):
  """The multi-turn engine sharded on a tensor 2 x fsdp 4 sampler mesh (weights as the rules
  say, slots over fsdp, kv heads over tensor) gives the one-device trajectories; also with
  the first prompts on pages of 8 (``prompt_pages``)."""
  base = _engine().rollout(PARAMS, _specs(4))
  mesh = sharding.make_mesh({"fsdp": 4, "tensor": 2})
  eng = _engine(mesh=mesh, rules="fsdp_tp", prompt_pages=prompt_pages,
                page_size=8 if prompt_pages else 64)
  out = eng.rollout(PARAMS, _specs(4))
  _same(base, out)
  assert eng.prepare_params(PARAMS)["embed"].sharding.mesh.size == 8


def test_small_pages_and_a_growing_pool_give_the_same_trajectories():
  """Trajectories on pages of 16 tokens (taken as turns and observations are written,
  returned when groups leave or are evicted), from a pool that starts at 32 tokens per
  sample and grows, equal those on pages of 64 (the default; 2 pages per sample here)."""
  base = _engine().rollout(PARAMS, _specs(3))
  eng = _engine(page_size=16, ttl=0.0)
  eng.pool_pages = eng.G * eng.M * 2  # the growing pool's first size: 32 tokens a sample
  out = eng.rollout(PARAMS, _specs(3, sleep="random"))
  _same(base, out)
  assert out.stats["pool_growths"] > 0 and out.stats["evictions"] > 0
  with pytest.raises(rollout.RolloutError, match="page_size must be a positive power of two"):
    _engine(page_size=12)


def test_turn_sync_baseline_gives_the_same_trajectories():
  cont = _engine().rollout(PARAMS, _specs(3, sleep="random"))
  sync = _engine(schedule="turn_sync").rollout(PARAMS, _specs(3, sleep="random"))
  _same(cont, sync)


def test_timeouts_errors_and_limits_are_flagged():
  eng = _engine(step_timeout=0.3)
  out = eng.rollout(PARAMS, _specs(1, raise_at=1, hang_at=2, long=True))
  assert (out.env_errors == 1).all() and (out.timeouts == 1).all()
  assert out.stats["timeouts"] == 2 and out.stats["env_errors"] == 2
  assert (out.truncated_obs).all()  # the third observation is long (but cut to 32 ids)
  assert (out.num_turns == 3).all()
  _check_exact(out, 1.0)
  # limits: max_turns, max_total_tokens, per-turn budget
  short = _engine(max_turns=2, max_turn_tokens=4).rollout(PARAMS, _specs(2))
  assert (short.finish_reason == "max_turns").all() and (short.num_turns == 2).all()
  assert short.truncated_turn.any()
  assert (np.diff(np.c_[np.zeros(4), short.turn_ends], axis=1)[:, :1] <= 4).all()
  tight = _engine(max_total_tokens=66).rollout(PARAMS, _specs(2, long=True))
  assert (tight.finish_reason == "max_tokens").all() and (tight.lengths <= 66).all()
  assert tight.truncated_obs.all()
  _check_exact(tight, 1.0)


def test_a_malformed_step_result_is_an_error_observation(capsys):
  """A step returning a NaN reward fails like a step that raises: an error observation the
  model reads, counted in env_errors, the reward 0, and one note on stderr per distinct
  failure (not one per step)."""
  out = _engine().rollout(PARAMS, _specs(2, nan_at=2))
  assert (out.env_errors == 1).all() and out.stats["env_errors"] == 4
  assert np.isfinite(out.turn_rewards).all() and (out.turn_rewards[:, 1] == 0).all()
  assert (out.num_turns == 3).all()
  _check_exact(out, 1.0)
  notes = [l for l in capsys.readouterr().err.splitlines() if l.startswith("note:")]
  assert notes == ["note: an environment step failed; the model sees the error as its "
                   "observation and reward_exceptions counts it: TypeError: step returned "
                   "reward nan, not a finite number"]
  # the checks themselves: what reset and step may return
  assert env_base.step_problem(StepResult(reward=1)) is None
  assert env_base.step_problem({"reward": 1.0}) == "step returned a dict, not a StepResult"
  assert env_base.step_problem(StepResult(reward="1")) == (
      "step returned reward '1', not a finite number")
  assert env_base.step_problem(StepResult(("ok",))) == (
      "step returned messages that are a list holding str, not Message")
  with pytest.raises(TypeError, match="reset returned a Message, not a list of Message"):
    env_base.opening_messages(type("E", (), {"reset": lambda s, e, k: Message("user", "x")})(),
                             {}, 0)


def test_bad_arguments():
  with pytest.raises(rollout.RolloutError, match="schedule"):
    _engine(schedule="sometimes")
  with pytest.raises(rollout.RolloutError, match="ttl"):
    _engine(ttl=-1.0)
  with pytest.raises(rollout.RolloutError, match="context"):
    _engine(max_total_tokens=400)
  with pytest.raises(rollout.RolloutError, match="max_prompt_len"):
    _engine(max_prompt_len=4).rollout(PARAMS, _specs(1))
  # the engine core's checks, the single-turn engine's lines
  for kw, words in ((dict(top_p=0.0), "top_p must lie in (0, 1]"),
                    (dict(top_k=-1), "top_k must be an integer >= 0"),
                    (dict(temperature=-0.5), "temperature must be >= 0"),
                    (dict(n=0), "n must be an integer >= 1")):
    with pytest.raises(rollout.RolloutError) as e:
      _engine(**kw)
    assert words in str(e.value) and "\n" not in str(e.value), kw
  assert rollout.env_seed(3, 1, 0) == rollout.env_seed(3, 1, 0) != rollout.env_seed(3, 1, 1)


def _by_uid(out):
  return {int(u): slice(i * 2, i * 2 + 2) for i, u in enumerate(out.group_ids)}


def test_held_groups_resume_exactly_across_calls_and_checkpoints():
  """APRIL across turns: unfinished groups are held (mid-turn, waiting on their environment
  or with an observation pending) and continue exactly; an engine rebuilt from
  ``export_held`` (environments replayed) continues like the original."""
  specs = _specs(12, sleep=0.02)
  ref = _engine().rollout(PARAMS, specs)
  ref_rows = _by_uid(ref)

  def held_after_three_calls():
    a, it_a, outs, resumed = _engine(over_sampling=3.0), iter(specs), [], 0
    for step in range(3):
      outs.append(a.rollout_groups(PARAMS, it_a, k_groups=1, policy_version=step))
      resumed += outs[-1].stats["resumed_groups"]
    waiting = a.export_held(capacity=8)  # environment steps still running: replayed
    time.sleep(0.1)  # now they finished: exported with their observations pending
    held = a.export_held(capacity=8)
    states = set(waiting["status"][waiting["valid"]].ravel()) | set(
        held["status"][held["valid"]].ravel())
    return a, it_a, outs, resumed, waiting, held, states

  # which states the held samples are in depends on the environment's timing (a sample
  # waiting on its last turn's step is done, not ready, once the step finishes): try until
  # one export has samples held mid-turn, waiting on the environment and ready
  for _ in range(4):
    a, it_a, outs, resumed, waiting, held, states = held_after_three_calls()
    if {0, 1, 2} <= states:
      break
  assert {0, 1, 2} <= states, states  # held mid-turn, waiting on the environment, ready
  assert held["valid"].sum() >= 2
  b, c = _engine(over_sampling=3.0), _engine(over_sampling=3.0)
  b.import_held(held, spec_of=lambda meta: specs[meta])
  c.import_held(waiting, spec_of=lambda meta: specs[meta])
  it_b = iter(specs[int(held["next_uid"]):])
  it_c = iter(specs[int(held["next_uid"]):])
  for step in range(3, 6):
    out_a = a.rollout_groups(PARAMS, it_a, k_groups=1, policy_version=step)
    for other, it_o in ((b, it_b), (c, it_c)):
      # (versions may differ: which call sampled a token depends on timing)
      _same(out_a, other.rollout_groups(PARAMS, it_o, k_groups=1, policy_version=step))
    outs.append(out_a)
    resumed += out_a.stats["resumed_groups"]
  assert resumed > 0, "no group was held and resumed; the test would not exercise APRIL"
  for out in outs:
    assert out.tokens.shape[0] == 2
    for uid, rows in _by_uid(out).items():
      r = ref_rows[uid]
      np.testing.assert_array_equal(out.tokens, ref.tokens[r])
      np.testing.assert_allclose(out.logprobs, ref.logprobs[r], atol=1e-5)
      assert out.actions == ref.actions[r] and (out.turn_rewards == ref.turn_rewards[r]).all()
      v = out.versions[out.model_mask]
      assert ((v >= 0) & (v <= 5)).all() and (out.versions[~out.model_mask] == -1).all()


def test_deterministic_schedule_holds_the_same_groups_whatever_the_tool_timing():
  """``deterministic=True`` (the trainer's APRIL mode): with tools of random latency, which
  groups complete, everything held and the token versions are the same in two runs, and an
  engine exported and re-imported around every call (a trainer resuming from each
  checkpoint) matches one that keeps its groups in memory."""
  specs = _specs(10, sleep="random")
  runs = []
  for reimport in (False, True):
    e = _engine(over_sampling=3.0, deterministic=True)
    it, outs = iter(specs), []
    for step in range(3):
      if reimport:
        e.import_held(e.export_held(capacity=8), spec_of=lambda meta: specs[meta])
      outs.append(e.rollout_groups(PARAMS, it, k_groups=1, policy_version=step))
    runs.append((outs, e.export_held(capacity=8)))
    e.close()
  (outs_a, held_a), (outs_b, held_b) = runs
  assert sum(o.stats["resumed_groups"] for o in outs_a) > 0 and held_a["valid"].sum() > 0
  for a, b in zip(outs_a, outs_b):
    assert list(a.group_ids) == list(b.group_ids)
    for k in ("tokens", "versions", "model_mask", "turn_rewards"):
      np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
  for k in held_a:
    if k not in ("env_time", "logprobs"):
      np.testing.assert_array_equal(held_a[k], held_b[k], err_msg=k)


@pytest.mark.parametrize("ttl_steps", [None, 0])
def test_deterministic_decode_batches_do_not_depend_on_tool_timing(ttl_steps):
  """The deterministic schedule with tools of random latency: two runs decode the same
  batches (log-probs bit-identical, the same decode calls, evictions and KV hits), every
  result joining ``result_delay`` decode steps after its call; the tokens are the
  wall-clock schedule's."""
  specs = _specs(6, sleep="random")
  outs = []
  for _ in range(2):
    e = _engine(deterministic=True, result_delay=3, ttl_steps=ttl_steps, max_slots=2)
    outs.append(e.rollout(PARAMS, specs))
    e.close()
  a, b = outs
  np.testing.assert_array_equal(a.logprobs, b.logprobs)
  for k in ("decode_calls", "evictions", "kv_hits", "resumes", "reprefill_tokens"):
    assert a.stats[k] == b.stats[k], k
  assert (a.stats["evictions"] > 0) == (ttl_steps == 0)
  e = _engine(max_slots=2)
  c = e.rollout(PARAMS, specs)
  e.close()
  np.testing.assert_array_equal(a.tokens, c.tokens)
  assert a.actions == c.actions
  _check_exact(a, 1.0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_a_fixed_pool_preempts_and_resumes_by_recompute(deterministic):
  """A fixed pool of one group's whole budget (3 slots would need 3): the newest group is
  preempted when the residents need more pages, keeps its partial turns and resumes by
  recompute; the trajectories are the growing pool's and the log-probs teacher forcing's.
  Tools of random latency with the deterministic schedule; without it, tools that answer at
  once (with random latency the wall-clock schedule may keep fewer groups resident at a time,
  and then the pool need not run out). Both report the single-turn engine's page counters
  (``PAGE_STATS``, which the producer copies into the step's metrics): the pages in use
  (peak within the pool), the prompt pages a group's samples share, the decode programs
  compiled."""
  specs = _specs(5, sleep="random" if deterministic else 0.0)
  kw = dict(max_slots=3, page_size=8, deterministic=deterministic)
  e = _engine(kv_pages=2 * 128 // 8, **kw)  # n x R/S (R: 96 rounded up)
  fixed = e.rollout(PARAMS, specs)
  e.close()
  assert fixed.stats["preemptions"] > 0
  e = _engine(**kw)
  grown = e.rollout(PARAMS, specs)
  e.close()
  for out in (fixed, grown):
    assert set(PAGE_STATS) <= set(out.stats)
    assert 0 < out.stats["kv_pages_used_mean"] <= out.stats["kv_pages_used_peak"]
    assert out.stats["kv_pages_used_peak"] <= out.stats["kv_pages"]
  # each group admitted once (no eviction, no preemption): M - 1 = 1 copy of its prompt saved
  assert grown.stats["preemptions"] == 0 and grown.stats["evictions"] == 0
  assert grown.stats["prefix_pages_shared"] == sum(-(-len(p) // 8) for p in grown.prompts) > 0
  assert grown.stats["decode_buckets"] == len(e.programs) >= 1
  _same(fixed, grown)
  _check_exact(fixed, 1.0)
  with pytest.raises(rollout.RolloutError, match="smaller than one group needs"):
    _engine(kv_pages=2 * 128 // 8 - 1, **kw)


def test_evicted_samples_sharing_their_tokens_are_forked_not_reprefilled():
  """Greedy samples of a group take the same turns, so when an evicted group comes back one
  sample is re-prefilled and the other forks its pages (``slots.forks``, as the single-turn
  engine's resumed samples do); the trajectories equal those where every sample is
  re-prefilled, and those of a run that evicts nothing."""
  specs = _specs(3)
  runs = {}
  for name, kw in (("base", {}), ("forked", dict(ttl_steps=0)),
                   ("plain", dict(ttl_steps=0, share_prefixes=False))):
    e = _engine(temperature=0.0, deterministic=True, result_delay=3, **kw)
    runs[name] = e.rollout(PARAMS, specs)
    e.close()
  base, forked, plain = runs["base"], runs["forked"], runs["plain"]
  assert forked.stats["evictions"] == plain.stats["evictions"] > 0
  assert forked.stats["forked_samples"] > 0 and plain.stats["forked_samples"] == 0
  assert forked.stats["fork_tokens_shared"] > 0
  assert (forked.stats["reprefill_tokens"] + forked.stats["fork_tokens_shared"]
          == plain.stats["reprefill_tokens"])
  _same(base, forked)
  _same(base, plain)


# a Qwen3-MoE policy: 2 MoE layers around a dense one, 4 experts, top 2 (float32)
MOE_CFG = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=48,
                             num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8,
                             max_position_embeddings=192, architecture="qwen3_moe",
                             qk_norm=True, num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, norm_topk_prob=True,
                             sparse_layers=(True, False, True), dtype="float32",
                             param_dtype="float32")


@pytest.fixture(scope="module")
def moe_params():
  return models.init_params(MOE_CFG, jax.random.key(1), std=0.2)


def _moe_engine(**kw):
  """The MoE policy's engine: 2 slots of 2 samples, 64 trajectory tokens (one shape for
  every test here, so a run of the file compiles its programs once)."""
  args = dict(n=2, max_slots=2, max_prompt_len=24, max_total_tokens=64, max_turn_tokens=12,
              max_turns=2, max_obs_tokens=32, stop_ids=STOP, seed=3, ttl=None, workers=4)
  args.update(kw)
  return rollout.AgentEngine(MOE_CFG, ChatRenderer(), TOK.decode, **args)


def test_a_mixture_of_experts_policy_runs_multi_turn(moe_params):
  """A Qwen3-MoE policy through the multi-turn loop: every layer's experts in the decode
  (the one decode program slices them per layer), log-probs equal to teacher forcing."""
  e = _moe_engine()
  out = e.rollout(moe_params, _specs(2))
  e.close()
  assert out.model_mask.sum() > 0
  _check_exact(out, 1.0, MOE_CFG, moe_params)


def _check_routing(out, params, cfg=MOE_CFG):
  """Each row's expert records [R,Y,X] against one teacher-forced pass over prompt +
  trajectory: every model token but the row's last (never fed) holds the experts the
  forward pass picks at its position, the rest (observation tokens, the last token,
  padding) -1."""
  B, R = out.tokens.shape
  assert out.routing.shape == (B, R, len(cfg.moe_layers), cfg.num_experts_per_tok)
  seqs = [out.prompts[out.prompt_index[b]] + out.tokens[b, :out.lengths[b]].tolist()
          for b in range(B)]
  batch = np.zeros((B, 32 + R), np.int32)
  for b, seq in enumerate(seqs):
    batch[b, :len(seq)] = seq
  _, route = jax.jit(lambda p, t: models.forward(cfg, p, t, return_routing=True))(
      params, jnp.asarray(batch))
  ids = np.moveaxis(np.asarray(route.ids), 0, 2)  # [B,T,Y,X]
  for b, seq in enumerate(seqs):
    n = int(out.lengths[b])
    p = len(seq) - n
    fed = out.model_mask[b].copy()
    fed[n - 1:] = False
    rec = out.routing[b]
    np.testing.assert_array_equal(np.sort(rec[fed], -1), np.sort(ids[b, p:p + R][fed], -1))
    assert (rec[~fed] == -1).all()


@pytest.fixture(scope="module")
def moe_multi_turn(moe_params):
  """Multi-turn episodes of the MoE policy on a fixed pool of one group's pages with a
  time-to-live of 0 steps: groups are preempted and evicted, and re-prefilled."""
  e = _moe_engine(page_size=8, kv_pages=2 * 64 // 8, deterministic=True, ttl_steps=0,
                  result_delay=3)
  out = e.rollout(moe_params, _specs(4))
  e.close()
  return out


def test_multi_turn_records_the_experts_of_every_model_token(moe_multi_turn, moe_params):
  """``AgentRollout.routing``: the experts the sampler chose for each model token at its
  trajectory index (a turn's last token recorded when ``extend`` feeds it with the
  observation), -1 on observation tokens; equal to a teacher-forced pass's, also for the
  samples re-prefilled after a preemption or an eviction (their earlier records kept)."""
  out = moe_multi_turn
  assert out.stats["preemptions"] > 0 and out.stats["evictions"] > 0
  assert out.stats["reprefill_tokens"] > 0
  assert (out.num_turns == 2).any()
  _check_routing(out, moe_params)


def test_replaying_the_multi_turn_records_gives_the_behaviour_logprobs(moe_multi_turn,
                                                                       moe_params):
  """The trainer's grouped log-prob pass (``models.response_logprobs``, packed layout) over
  prompt + trajectory with the records replayed equals the behaviour log-probs at every
  model token (float32); the same records one position off change them, so they are
  replayed where they were recorded."""
  out = moe_multi_turn
  B, R = out.tokens.shape
  G, M = B // 2, 2
  prompts = np.zeros((G, 24), np.int32)
  for g, p in enumerate(out.prompts):
    prompts[g, :len(p)] = p
  lengths = np.asarray([len(p) for p in out.prompts], np.int32)
  tokens = out.tokens.reshape(G, M, R)
  lp = jax.jit(lambda p, r: models.response_logprobs(MOE_CFG, p, prompts, lengths, tokens,
                                                     routing=r))
  replayed = np.asarray(lp(moe_params, out.routing.reshape(G, M, R, 2, 2))).reshape(B, R)
  mask = out.model_mask
  np.testing.assert_allclose(replayed[mask], out.logprobs[mask], atol=1e-5)
  shifted = np.roll(out.routing, 1, axis=1).reshape(G, M, R, 2, 2)
  moved = np.asarray(lp(moe_params, shifted)).reshape(B, R)
  assert np.abs(moved - out.logprobs)[mask].max() > 1e-3


@pytest.mark.parametrize("prompt_pages", [False, True])
def test_held_multi_turn_groups_keep_their_expert_records(moe_params, prompt_pages):
  """APRIL across turns on the MoE policy: ``export_held`` writes each held sample's
  records, an engine rebuilt by ``import_held`` holds the same ones, both return the same
  groups with the same records, and every returned group's records are those of a
  teacher-forced pass (resumed groups included); also with the first prompts on pages,
  whose trajectories open with the prompt's ids and export without them."""
  specs = _specs(10)
  make = lambda: _moe_engine(over_sampling=3.0, deterministic=True, prompt_pages=prompt_pages)
  a, it_a = make(), iter(specs)
  outs = [a.rollout_groups(moe_params, it_a, k_groups=1, policy_version=v) for v in range(2)]
  held = a.export_held(capacity=6)
  assert held["routing"].shape == (6, 2, 64, 2, 2)
  groups = list(a.ready) + list(a.buffer)
  partial = 0
  for h, grp in enumerate(groups):
    for m, t in enumerate(grp.trajs):
      assert (grp.skip > 0) == prompt_pages
      t = t.after(grp.skip)
      n = len(t.tokens)
      if n:
        np.testing.assert_array_equal(held["routing"][h, m, :n], t.routing)
        partial += int(not t.finish)
      assert (held["routing"][h, m, n:] == -1).all()
  assert partial and (held["routing"][held["valid"]] >= 0).any()
  b = make()
  b.import_held(held, spec_of=lambda meta: specs[meta])
  for ga, gb in zip(groups, list(b.ready) + list(b.buffer)):
    for ta, tb in zip(ga.trajs, gb.trajs):
      ra, rb = ta.after(ga.skip).routing, tb.after(gb.skip).routing
      if ra is None or rb is None:  # none recorded: no token fed after the prompt
        assert (ra is None or not len(ra)) and (rb is None or not len(rb))
      else:
        np.testing.assert_array_equal(rb, ra)
  it_b = iter(specs[int(held["next_uid"]):])
  for v in range(2, 4):
    out_a = a.rollout_groups(moe_params, it_a, k_groups=1, policy_version=v)
    out_b = b.rollout_groups(moe_params, it_b, k_groups=1, policy_version=v)
    np.testing.assert_array_equal(out_a.tokens, out_b.tokens)
    np.testing.assert_array_equal(out_a.routing, out_b.routing)
    outs.append(out_a)
  a.close()
  b.close()
  assert sum(o.stats["resumed_groups"] for o in outs) > 0, "no held group was resumed"
  for out in outs:
    _check_routing(out, moe_params)


def test_a_timed_out_step_is_replayed_as_recorded():
  """Groups held while their first step had timed out: exported and imported into a new
  engine (environments replayed), each sample sees the time-out's error observation again
  and the next call returns what the engine that kept its groups returns."""
  specs = _specs(6, hang_at=1, hang_s=0.4)
  outs, held = [], []
  for reimport in (False, True):
    e = _engine(over_sampling=3.0, deterministic=True, step_timeout=0.1)
    it = iter(specs)
    first = e.rollout_groups(PARAMS, it, k_groups=1, policy_version=0)
    assert (first.timeouts >= 1).all()
    d = e.export_held(capacity=8)
    if reimport:
      e.close()
      e = _engine(over_sampling=3.0, deterministic=True, step_timeout=0.1)
      e.import_held(d, spec_of=lambda meta: specs[meta])
    held.append({g.uid: [t.messages for t in g.trajs] for g in e.buffer})
    outs.append(e.rollout_groups(PARAMS, it, k_groups=1, policy_version=1))
    e.close()
  assert held[0] == held[1] and held[0]
  # (the error text is cut to the observation limit)
  assert any(m.content.startswith("error: environment step t")
             for msgs in held[1].values() for ms in msgs for m in ms)
  _same(outs[0], outs[1])
  assert outs[0].timeouts.sum() == outs[1].timeouts.sum() > 0


def test_staleness_bound_across_turns():
  eng = _engine(over_sampling=2.0, max_staleness=1, max_turns=6)
  specs = [rollout.EpisodeSpec(CounterEnv, {"q": f"q{i}", "turns": 6 if i % 3 == 0 else 1})
           for i in range(40)]
  it = iter(specs)
  restarted = 0
  for step in range(6):
    out = eng.rollout_groups(PARAMS, it, k_groups=2, policy_version=step)
    assert out.stats["max_token_lag"] <= 1
    assert ((step - out.versions)[out.model_mask] <= 1).all()
    restarted += out.stats["restarted_samples"]
  assert restarted > 0, "no sample outlived the bound; the test would not exercise it"
  _check_exact(out, 1.0)


def test_warmup_compiles_every_shape_up_front():
  eng = _engine(ttl=0.0, over_sampling=3.0)
  eng.warmup(PARAMS)
  assert eng.warmup(PARAMS) == 0  # everything already compiled
  before = dict(sampler.TRACE_COUNTS)
  eng.rollout(PARAMS, _specs(5, sleep="random", long=True))
  it = iter(_specs(8))
  for step in range(3):
    eng.rollout_groups(PARAMS, it, k_groups=1, policy_version=step)
  assert dict(sampler.TRACE_COUNTS) == before


# long episodes among short ones: held groups outlive the staleness bound and restart
_FIRST_PROMPT_SPECS = [rollout.EpisodeSpec(lambda: CounterEnv(sleep="random"),
                                           {"q": f"q{i}", "turns": 3 if i % 3 == 0 else 1},
                                           meta=i) for i in range(10)]
# the first prompts on pages of 8; 56 trajectory ids after the prompt: the longest episodes
# end on it ("max_tokens")
_FIRST_PROMPT_KW = dict(prompt_pages=True, page_size=8, deterministic=True, result_delay=3,
                        max_total_tokens=56)


def test_the_first_prompt_on_pages_gives_the_slot_layouts_trajectories():
  """``prompt_pages``: each first prompt's ids after its first on pool pages (the group's
  first sample prefills them, the other forks them). The slot layout's trajectories, with a
  fixed pool that preempts and a time-to-live of 0 steps (groups re-prefilled from prompt and
  history), log-probs equal to teacher forcing. (Across calls with held groups:
  ``test_held_groups_with_the_first_prompt_on_pages_continue_in_either_layout``.)"""
  specs, kw = _FIRST_PROMPT_SPECS, _FIRST_PROMPT_KW
  ref = _engine(max_total_tokens=56).rollout(PARAMS, specs)
  assert "max_tokens" in ref.finish_reason
  e = _engine(max_slots=3, kv_pages=2 * 128 // 8, ttl_steps=0, **kw)  # n x (23 + 56 -> 128)/8
  out = e.rollout(PARAMS, specs)
  e.close()
  for k in ("preemptions", "evictions", "prefix_pages_shared", "forked_samples"):
    assert out.stats[k] > 0, k
  _same(ref, out)
  assert out.prompts == ref.prompts and out.tokens.shape == ref.tokens.shape
  _check_exact(out, 1.0)


# the fast suite has its parts: multi-turn held groups exported and imported
# (test_held_groups_resume_exactly_across_calls_and_checkpoints), held groups with the
# prompt on pages (test_rollout_engine.py::test_april_returns_k_groups_and_resumes_exactly)
# and multi-turn first prompts on pages re-prefilled (the test above)
@pytest.mark.slow
def test_held_groups_with_the_first_prompt_on_pages_continue_in_either_layout():
  """``prompt_pages`` across calls with held groups and the staleness bound's restarts: the
  slot layout's trajectories. ``export_held`` writes the slot layout's arrays: an engine of
  either layout continues from them."""
  specs, kw = _FIRST_PROMPT_SPECS, _FIRST_PROMPT_KW
  ref = _engine(max_total_tokens=56).rollout(PARAMS, specs)
  rows = _by_uid(ref)

  def check(o):
    for uid, r in _by_uid(o).items():
      np.testing.assert_array_equal(o.tokens, ref.tokens[rows[uid]])
      np.testing.assert_allclose(o.logprobs, ref.logprobs[rows[uid]], atol=1e-5)
      assert o.actions == ref.actions[rows[uid]]
      assert o.prompts == [ref.prompts[rows[uid].start // 2]]

  a, it = _engine(over_sampling=3.0, max_staleness=2, **kw), iter(specs)
  check(a.rollout_groups(PARAMS, it, k_groups=1, policy_version=0))
  d = a.export_held(capacity=8)
  # samples held mid-turn (running, some tokens sampled): their turn's budget is imported
  st, n = d["status"][d["valid"]].ravel(), d["length"][d["valid"]].ravel()
  assert ((st == 0) & (n > 0)).any()
  assert d["tokens"].shape[-1] == ref.tokens.shape[1] and (d["prompt_len"][d["valid"]] > 1).all()
  others = [_engine(over_sampling=3.0, max_staleness=2, **dict(kw, prompt_pages=p))
            for p in (False, True)]
  its = [iter(specs[int(d["next_uid"]):]) for _ in others]
  for o, i in zip(others, its):
    o.import_held(d, spec_of=lambda meta: specs[meta])
  restarted = 0
  for v in range(1, 5):  # the held group completes at v = 2 (its turn's budget imported)
    outs = [x.rollout_groups(PARAMS, i, k_groups=1, policy_version=v)
            for x, i in zip([a] + others, [it] + its)]
    for o in outs:
      check(o)
      assert list(o.group_ids) == list(outs[0].group_ids)
      assert o.stats["restarted_samples"] == outs[0].stats["restarted_samples"]
    restarted += outs[0].stats["restarted_samples"]
  for x in [a] + others:
    x.close()
  assert restarted > 0
