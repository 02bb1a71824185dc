"""Multi-turn training end to end (``env.name``): the agentic producer trains and writes its
metrics, the learner scores exactly the sampled trajectory ids, observations are masked from
the loss, the learner's proximal log-probs of every turn are recomputed from its own weights,
GiGPO trains through the trainer, a mixture-of-experts policy trains with router replay,
SIGKILL + rerun of an asynchronous run holding partial multi-turn trajectories (APRIL) is
bit-exact, the training engine's episodes on 8 devices equal those on 1, bad env settings
fail in one line.

The runs use the guess game with 4 targets and 2 turns (the 8-device comparison: the
quickstart's 5): after a short warm start the policy guesses digits, so groups have reward
variance and first-turn misses get an observation.
"""

import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
from safetensors.numpy import load_file

import jax
import jax.numpy as jnp

from rl_jax import checkpoint, config_utils, metrics, models, train
from rl_jax.errors import CheckpointError, ConfigError
from rl_jax.rollout import kv_cache
from rl_jax.train import agent_stage, learner, loop, producer, resume, rollouts
from rl_jax.train import state as state_lib
from rl_jax.train.context import build_setup
from tests.tiny import ROOT, TINY_MODEL, assert_prompts_as_sampled

AGENT_QUICKSTART = os.path.join(ROOT, "configs", "agent_quickstart.py")
TINY = TINY_MODEL + [
    "env.guess_n=4", "env.max_turns=2", "env.max_total_tokens=24", "env.max_turn_tokens=3",
    "env.max_obs_tokens=12", "env.n_train=64", "data.eval_size=4", "sft.steps=10",
    "sft.lr=1e-2", "sft.batch_size=16", "train.steps=3", "train.batch_groups=4",
    "rollout.n=4", "rollout.temperature=0.5", "train.eval_every=13",
    "train.checkpoint_every=1", "log.tensorboard=False"]
# wall-clock metrics (seconds, per-second rates, utilisation): the only ones a resumed run
# may not reproduce
def _wall_clock(name):
  return name.endswith("_s") or name.endswith("_utilisation")


def _config(overrides=()):
  return config_utils.load_config(AGENT_QUICKSTART + ":guess", list(TINY) + list(overrides))


def _rl_rows(workdir):
  return [r for r in metrics.read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if r["phase"] == "rl"]


def first_batch(s):
  """Step 0 of setup ``s`` from its initial weights, produced and packed for the learner:
  (trainer, state, the scored groups, the update batch); the engines are closed."""
  t = loop.make_trainer(s)
  try:
    st = state_lib.init_state(s)
    scored, _ = producer.produce(t, t.layout.sampler_params(st.params), st.producer, step=0,
                                 version=0, lo=0, hi=s.geometry.groups)
    batch, _ = learner.learner_batch(t, st, scored)
  finally:
    for e in t.agent:
      e.close()
  return t, st, scored, batch


def test_calculator_tool_metrics_and_error_kinds():
  """The calculator's tool calls and per-kind tool errors reach the step metrics."""
  from rl_jax.rollout.agent_records import AgentRollout  # pylint: disable=import-outside-toplevel
  from rl_jax.train import agent_stage  # pylint: disable=import-outside-toplevel
  B, R, U = 2, 4, 2
  z = lambda dt: np.zeros(B, dt)
  out = AgentRollout(
      tokens=np.zeros((B, R), np.int32), lengths=z(np.int32), model_mask=np.zeros((B, R), bool),
      logprobs=np.zeros((B, R), np.float32), versions=np.zeros((B, R), np.int32),
      turn=np.zeros((B, R), np.int32), turn_rewards=np.zeros((B, U), np.float32),
      turn_ends=np.zeros((B, U), np.int32), num_turns=np.asarray([1, 2], np.int32),
      reward=z(np.float32), tool_calls=np.asarray([1, 2], np.int32),
      tool_errors=np.asarray([0, 1], np.int32), timeouts=z(np.int32), env_errors=z(np.int32),
      env_time=np.asarray([0.5, 0.25], np.float32), truncated_obs=z(bool),
      truncated_turn=z(bool), finish_reason=np.asarray(["done", "max_turns"]), actions=[[], []],
      prompts=[[1]], prompt_index=np.zeros(B, np.int32), group_ids=np.zeros(1, np.int64),
      group_meta=[None], stats={"env_wait_s": 0.25, "kv_hit_rate": 1.0},
      tool_latency=np.asarray([0.1, 0.2], np.float32), error_kinds=[{}, {"parse": 1}])
  m = agent_stage.rollout_metrics(out)
  assert m["tool_calls"] == 3 and m["tool_errors"] == 1 and m["tool_errors_parse"] == 1
  assert m["turns_mean"] == 1.5 and m["truncated_trajectories"] == 1
  assert m["env_time_s"] == 0.75 and m["env_time_hidden_s"] == 0.5
  assert abs(m["tool_latency_s"] - 0.3) < 1e-6


def test_learner_scores_the_sampled_trajectory_ids(tmp_path):
  """Old log-probs of the packed training layout == the engine's behaviour log-probs on
  model tokens (float32); the loss mask is the model tokens, observations excluded."""
  s = build_setup(_config(["sft.steps=0", "train.old_logp_pass=separate"]))
  t, st, scored, batch = first_batch(s)
  G, M, R = s.geometry.groups, s.geometry.samples, s.geometry.new_tokens
  mask = scored.mask.reshape(G, M, R)
  old = np.asarray(batch.inputs.old_logp)
  np.testing.assert_allclose(old[mask], scored.logprobs.reshape(G, M, R)[mask], atol=1e-5)
  assert np.array_equal(np.asarray(batch.inputs.mask), mask)
  assert np.array_equal(np.asarray(batch.tokens), scored.tokens.reshape(G, M, R))
  # the groups carry the first prompts they were rolled out from, padded as the learner
  # packs them (it never tokenizes them again)
  assert_prompts_as_sampled(s, scored)
  np.testing.assert_array_equal(np.asarray(batch.prompt_tokens), scored.prompts)
  np.testing.assert_array_equal(np.asarray(batch.prompt_lengths), scored.prompt_lens)
  # observation tokens: inside the trajectory, not sampled, never in the loss
  turn_ids = scored.turns["turn_ids"]
  length = np.asarray([r.max(initial=-1) for r in
                       np.where(scored.tokens != 0, np.arange(R)[None], -1)]) + 1
  obs = (np.arange(R)[None] < length[:, None]) & ~scored.mask  # appended ids of a row
  assert obs.any() and not (np.asarray(batch.inputs.mask).reshape(-1, R) & obs).any()
  assert (turn_ids[~scored.mask] == -1).all() and (turn_ids[scored.mask] >= 0).all()
  # weights moved since sampling (an asynchronous learner): the proximal log-probs of every
  # turn are recomputed from the learner's weights (a teacher-forced pass over prompt +
  # trajectory), not the behaviour log-probs of the sampler
  st2 = st._replace(params=jax.tree.map(lambda w: w * 1.1, st.params))
  old2 = np.asarray(learner.learner_batch(t, st2, scored)[0].inputs.old_logp).reshape(-1, R)
  prompts = rollouts.encode_prompts(s, [s.train_examples[i] for i in scored.indices])
  seqs = [prompts[b // M] + scored.tokens[b, :length[b]].tolist() for b in range(G * M)]
  rows = np.zeros((G * M, max(map(len, seqs))), np.int32)
  for b, seq in enumerate(seqs):
    rows[b, :len(seq)] = seq
  logits = models.forward(s.model_cfg, jax.device_get(st2.params), jnp.asarray(rows))
  logp = np.asarray(jax.nn.log_softmax(logits / s.rollout.temperature))
  flat_mask, later = scored.mask.reshape(-1, R), turn_ids > 0
  for b, seq in enumerate(seqs):
    p = len(prompts[b // M])
    ref = np.asarray([logp[b, p + j - 1, seq[p + j]] for j in range(length[b])])
    m = flat_mask[b, :length[b]]
    np.testing.assert_allclose(old2[b, :length[b]][m], ref[m], atol=2e-5)
  assert (flat_mask & later).any()  # later turns are in the batch ...
  assert np.abs(old2 - scored.logprobs.reshape(-1, R))[flat_mask & later].max() > 1e-4  # ... moved


# a one-layer Qwen3-MoE policy (4 experts, top 2) that trains on the sampler's experts
MOE_REPLAY = ["model.architecture=qwen3_moe", "model.num_experts=4",
              "model.moe_intermediate_size=16", "model.router_replay=True", "sft.steps=0",
              "train.steps=1", "train.old_logp_pass=separate"]


def test_router_replay_trains_a_multi_turn_moe_policy():
  """``model.router_replay=True`` with ``env.name``: the multi-turn batch carries the
  sampler's expert records (model tokens recorded, observation tokens -1), the learner's
  proximal log-probs replaying them equal the behaviour log-probs (float32), and an RL step
  replays them in every pass (no routing mismatch, ratios 1)."""
  s = build_setup(_config(MOE_REPLAY))
  assert s.model_cfg.is_moe and s.model.router_replay
  t = loop.make_trainer(s)
  try:
    st = train.begin_rl(s, state_lib.init_state(s))
    scored, _ = producer.produce(t, t.layout.sampler_params(st.params), st.producer, step=0,
                                 version=0, lo=0, hi=s.geometry.groups)
    batch, _ = learner.learner_batch(t, st, scored)
    G, M, R = s.geometry.groups, s.geometry.samples, s.geometry.new_tokens
    assert scored.routing.shape == (G * M, R, 1, 2)
    length = np.asarray([r.max(initial=-1) for r in
                         np.where(scored.tokens != 0, np.arange(R)[None], -1)]) + 1
    obs = (np.arange(R)[None] < length[:, None]) & ~scored.mask
    assert obs.any() and (scored.routing[obs] == -1).all()
    last = np.arange(R)[None] == length[:, None] - 1  # a row's last token is never fed
    assert (scored.routing[scored.mask & ~last] >= 0).all()
    np.testing.assert_array_equal(np.asarray(batch.routing), scored.routing.reshape(
        G, M, R, 1, 2))
    mask = scored.mask.reshape(G, M, R)
    np.testing.assert_allclose(np.asarray(batch.inputs.old_logp)[mask],
                               scored.logprobs.reshape(G, M, R)[mask], atol=1e-5)
    _, record, _ = train.rl_step(t, st)
  finally:
    for e in t.agent:
      e.close()
  assert record["routing_mismatch"] == 0.0 and np.isfinite(record["loss"])
  assert record["ratio_mean"] == pytest.approx(1.0, abs=1e-6)


def test_held_multi_turn_groups_without_expert_records_are_an_earlier_layout(tmp_path):
  """A mixture-of-experts policy's held multi-turn groups keep their expert records
  (``producer/held/routing``); a checkpoint written before they did fails in one line that
  says so, before any array is read, and a current one restores."""
  s = build_setup(_config(MOE_REPLAY + ["rollout.partial=True", "train.mode=async"]))
  state = state_lib.init_state(s)
  held = dict(state.producer.held)
  assert held.pop("routing").shape[-2:] == (1, 2)
  old = state._replace(producer=state.producer._replace(held=held))
  with checkpoint.Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.save(1, old._replace(step=jnp.asarray(1, jnp.int32)))
    ckpt.save(2, state._replace(step=jnp.asarray(2, jnp.int32)))
    with pytest.raises(CheckpointError) as err:
      resume.restore_state(s, ckpt, 1, train.abstract_state(s, 1))
    restored = resume.restore_state(s, ckpt, 2, train.abstract_state(s, 2))
  msg = str(err.value)
  assert "\n" not in msg and "earlier state layout" in msg, msg
  assert "producer/held/routing" in msg, msg
  np.testing.assert_array_equal(restored.producer.held["routing"], state.producer.held["routing"])


def test_agentic_gigpo_run_trains_and_writes_metrics(tmp_path):
  """A synchronous run (GiGPO's turn-level advantages) trains, logs the multi-turn metrics
  every step and evaluates greedy episodes at its end."""
  train.train(_config(["loss.advantage=gigpo", "train.checkpoint_every=0"]), str(tmp_path),
              progress=False)
  rows = _rl_rows(str(tmp_path))
  assert len(rows) == 3
  for key in ("turns_mean", "tool_calls", "tool_errors", "tool_latency_s", "env_time_s",
              "env_time_hidden_s", "truncated_trajectories", "kv_hit_rate", "reward_mean"):
    assert all(key in r for r in rows), key
  assert 1.0 <= rows[0]["turns_mean"] <= 2.0
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert any(r["grad_norm"] > 0 for r in rows)  # groups with reward variance were trained
  last = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))[-1]
  assert 0.0 <= last["eval_accuracy"] <= 1.0 and 1.0 <= last["eval_turns_mean"] <= 2.0


# the guess game's own limits in configs/agent_quickstart.py: up to 5 turns of 4 ids
GUESS_LIMITS = ["env.max_turns=5", "env.max_total_tokens=40", "env.max_turn_tokens=4"]


def test_agent_quickstart_episodes_on_8_devices_equal_1():
  """The training engine (``agent_stage.make_engine``) of the agent quickstart's guess setup
  on a sampler mesh of 8 devices (weights and slots split over fsdp) rolls the same 8 groups
  as on 1 device from the same warm-started weights: the same sampled and observation ids,
  turn boundaries, rewards and finish reasons, the behaviour log-probs to 1e-5."""
  one, eight = (build_setup(_config(GUESS_LIMITS + ["train.batch_groups=8",
                                                    f"mesh.num_devices={n}"])) for n in (1, 8))
  assert one.sampler_mesh.size == 1 and eight.sampler_mesh.size == 8
  t = loop.make_trainer(one)
  st = state_lib.init_state(one)
  for _ in range(one.sft.steps):  # warm start: several turns, reward variance
    st, _, data = loop.sft_step(t, st)
    st = st._replace(producer=st.producer._replace(data=data))
  for e in t.agent:
    e.close()
  params = jax.device_get(st.params)  # host arrays, placed by each engine on its mesh
  outs, placed = [], []
  for s in (one, eight):
    eng = agent_stage.make_engine(s, s.rollout.temperature)
    try:
      outs.append(agent_stage.roll(s, eng, params, np.arange(8), step=0, version=0))
      # the weights and the decode state (its slots) as the engine's programs take them
      state = kv_cache.init_state(eng.cfg, eng.G, eng.M, eng.P, eng.R, ctx=eng.ctx, S=eng.S,
                                  pages=eng.pool_pages)
      placed.append((eng.prepare_params(params)["embed"], state.tokens))
    finally:
      eng.close()
  for x in placed[0]:
    assert len(x.sharding.device_set) == 1
  for x in placed[1]:  # split over the 8 devices, not replicated
    assert len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated
  a, b = outs
  R = a.tokens.shape[1]
  obs = ~a.model_mask & (np.arange(R)[None] < a.lengths[:, None])
  assert obs.any() and (a.num_turns == 1).any() and (a.num_turns >= 3).any()
  assert 0 < a.reward.sum() < len(a.reward)
  for k in ("tokens", "lengths", "model_mask", "turn", "turn_ends", "num_turns", "turn_rewards",
            "reward", "finish_reason", "truncated_obs", "truncated_turn", "versions",
            "state_ids", "prompt_index", "group_ids"):
    np.testing.assert_array_equal(getattr(a, k), getattr(b, k), err_msg=k)
  assert a.prompts == b.prompts and a.actions == b.actions
  np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)


# asynchronous (one step off) with partial rollouts: groups held mid-turn or waiting on
# their environment cross steps and checkpoints; checkpoints at step 11 (the first RL step,
# where the test below kills the run) and at the end only, the supervised steps' play no part
HELD = ["rollout.partial=True", "train.mode=async", "train.checkpoint_every=11"]


def _partial_groups(held):
  """Held groups (``ProducerState.held`` of the multi-turn engine) with a sample not done:
  mid-turn, waiting on its environment or with an observation to append."""
  done = 3  # ``AgentEngine.export_held``'s status indexes run, wait, ready, done
  status = np.asarray(held["status"])[np.asarray(held["valid"])]
  return int((status != done).any(axis=1).sum())


def test_resume_with_held_trajectories_after_sigkill_is_bit_exact(tmp_path, monkeypatch):
  """SIGKILL right after the checkpoint of the first RL step (step 11 of 13) is on disk,
  while the multi-turn engine holds partial trajectories in it; the rerun of the same run
  restores that step (held groups imported, environments replayed) and finishes with the
  uninterrupted run's weights bit for bit and its metrics, wall-clock ones aside, equal
  (the behaviour log-prob mismatch and the KV hit rate included: the engine's lockstep
  schedule makes its decode batches a function of the seeds)."""
  ref_dir, killed_dir = str(tmp_path / "ref"), str(tmp_path / "killed")
  train.train(_config(HELD), ref_dir, progress=False)
  ref = metrics.read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
  rl = [r for r in ref if r["phase"] == "rl"]
  assert all(r["buffer_size"] > 0 for r in rl) and max(r["max_token_lag"] for r in rl) >= 1
  kill_at = 11  # the first RL step: its checkpoint holds groups (not the last step's)
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={AGENT_QUICKSTART}:guess",
         f"--workdir={killed_dir}"] + [f"--config.{o}" for o in TINY + HELD]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  ckpts = os.path.join(killed_dir, "checkpoints")
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if os.path.isdir(ckpts) and kill_at in checkpoint.all_steps(ckpts):
      break  # committed (the rename after orbax's commit marker): restorable
    time.sleep(0.02)
  proc.kill()
  proc.wait()
  assert not os.path.exists(os.path.join(killed_dir, "hf")), "run finished before the kill"
  for step in checkpoint.all_steps(ckpts):  # as if killed just after saving step kill_at
    if step > kill_at:
      shutil.rmtree(os.path.join(ckpts, str(step)))
  assert checkpoint.latest_step(ckpts) == kill_at
  restored = []

  def restore_newest(*args):
    state = resume.restore_newest(*args)
    restored.append((int(state.step), _partial_groups(jax.device_get(state.producer.held))))
    return state

  monkeypatch.setattr(loop, "restore_newest", restore_newest)
  train.train(_config(HELD), killed_dir, progress=False)
  # the rerun resumed from the RL step's checkpoint, holding partial multi-turn groups
  assert restored[0][0] == kill_at and restored[0][1] > 0, restored
  a = load_file(os.path.join(ref_dir, "hf", "model.safetensors"))
  b = load_file(os.path.join(killed_dir, "hf", "model.safetensors"))
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)
  exact = lambda rows: [{k: v for k, v in r.items() if not _wall_clock(k)} for r in rows]
  assert exact(metrics.read_jsonl(os.path.join(killed_dir, "metrics.jsonl"))) == exact(ref)


@pytest.mark.parametrize("override,needle", [
    ("env.name=chess", "config.env.name"),
    ("env.max_turns=0", "config.env.max_turns"),
    ("env.kv_ttl_steps=-2", "config.env.kv_ttl_steps"),
    ("env.result_delay_steps=0", "config.env.result_delay_steps"),
    ("rollout.kv_pages=3", "(env.max_total_tokens=24)"),
    # the first prompt on pages: 16 pages of 8 hold a group in the slot layout, not with it
    ("rollout.prompt_pages=True rollout.page_size=8 rollout.kv_pages=16",
     "(data.max_prompt_len - 1 + env.max_total_tokens=47)"),
    ("env.max_turn_tokens=64", "env.max_turn_tokens=64 exceeds"),
    ("rollout.speculative=True", "not supported with rollout.speculative=True"),
    ("data.selector=greso", "not supported with data.selector=greso"),
])
def test_bad_env_settings_fail_in_one_line(override, needle):
  with pytest.raises(ConfigError) as e:
    build_setup(_config(override.split()))
  assert needle in str(e.value) and "\n" not in str(e.value)


def test_turn_inputs_need_an_environment():
  with pytest.raises(ConfigError) as e:
    build_setup(config_utils.load_config(os.path.join(ROOT, "configs", "quickstart.py"),
                                         ["loss.advantage=gigpo"]))
  assert "env.name" in str(e.value) and "\n" not in str(e.value)
