"""The trainer end to end: learning, exact resume after SIGKILL, 8 devices == 1, errors."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from rl_jax import checkpoint, config_utils, losses, metrics, train
from rl_jax import config as config_lib
from rl_jax.data.base import split_of
from rl_jax.errors import CheckpointCorruptError, ConfigError, DataError, RLJaxError
from rl_jax.train import loop
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL, stopped_at


# A very small run: 1-layer model, a few supervised and RL steps.
TINY = TINY_MODEL + [
    "sft.steps=3", "sft.batch_size=8", "train.steps=3", "train.batch_groups=4",
    "rollout.n=4", "train.eval_every=0", "train.checkpoint_every=1", "log.tensorboard=False",
]


def _config(overrides=()):
  return config_utils.load_config(QUICKSTART, list(TINY) + list(overrides))


def _final_weights(workdir):
  return load_file(os.path.join(workdir, "hf", "model.safetensors"))


def _assert_same_weights(a, b):
  assert a.keys() == b.keys()
  for k in a:
    np.testing.assert_array_equal(a[k], b[k], err_msg=k)


# the one metrics row of a run that died before its first checkpoint
STALE_ROW = {"step": 1, "phase": "sft", "sft_loss": 123.0}


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  """The workdir of one finished ``_config()`` run, shared read-only by the tests below. It
  starts in a workdir left by a run that died before its first checkpoint: one metrics row
  and no checkpoint (``test_rerun_before_the_first_checkpoint_rewrites_metrics``)."""
  workdir = tmp_path_factory.mktemp("tiny_run")
  with open(workdir / "metrics.jsonl", "w") as f:
    f.write(json.dumps(STALE_ROW) + "\n")
  train.train(_config(), str(workdir), progress=False)
  return str(workdir)


@pytest.mark.parametrize("extra", [
    # per-prompt state checkpointed; QLoRA adapters on an int4 base (supervised ones merged
    # at RL start, the base quantised again); speculative continuations with the prompts on
    # pool pages
    (), ("data.selector=beta", "rollout.speculative=True", "model.lora.rank=4",
         "model.lora.quant=int4", "model.lora.quant_block=16", "loss.kl_beta=0.05",
         "rollout.prompt_pages=True")])
def test_resume_after_sigkill_is_bit_exact(tmp_path, extra, request):
  killed_dir = str(tmp_path / "killed")
  if extra:
    ref_dir = str(tmp_path / "ref")
    train.train(_config(extra), ref_dir, progress=False)
  else:
    ref_dir = request.getfixturevalue("tiny_run")
  kill_after = int(np.random.default_rng(0).integers(1, 6))  # steps 1..5 of 6
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={killed_dir}"]
  cmd += [f"--config.{o}" for o in list(TINY) + list(extra)]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  path = os.path.join(killed_dir, "metrics.jsonl")
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None:
    if len(metrics.read_jsonl(path)) >= kill_after:
      break
    time.sleep(0.05)
  proc.kill()
  proc.wait()
  assert not os.path.exists(os.path.join(killed_dir, "hf")), "run finished before the kill"
  train.train(_config(extra), killed_dir, progress=False)  # the same command resumes
  _assert_same_weights(_final_weights(ref_dir), _final_weights(killed_dir))
  steps = [r["step"] for r in metrics.read_jsonl(path)]
  assert steps == sorted(set(steps)) and steps[-1] == 6  # no duplicated or missing step
  ref_rows = metrics.read_jsonl(os.path.join(ref_dir, "metrics.jsonl"))
  rows = metrics.read_jsonl(path)
  assert [r.get("reward_mean") for r in rows] == [r.get("reward_mean") for r in ref_rows]


def test_sigterm_saves_and_exits_cleanly(tmp_path):
  workdir = str(tmp_path / "run")
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}", f"--workdir={workdir}"]
  cmd += [f"--config.{o}" for o in TINY] + ["--config.train.checkpoint_every=0",
                                            "--config.train.steps=200"]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
  path = os.path.join(workdir, "metrics.jsonl")
  deadline = time.time() + 600
  while time.time() < deadline and proc.poll() is None and len(metrics.read_jsonl(path)) < 5:
    time.sleep(0.05)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err
  assert "SIGTERM: saved checkpoint" in err
  last = metrics.read_jsonl(path)[-1]["step"]
  assert 5 <= last < 203
  assert checkpoint.latest_step(os.path.join(workdir, "checkpoints")) == last


def test_kl_run_checkpoints_during_the_supervised_stage(tmp_path):
  """The reference must not share (donated) buffers with the policy during SFT."""
  state = train.train(_config(["loss.kl_beta=0.01"]), str(tmp_path), progress=False)
  assert int(state.step) == 6 and state.ref_params
  assert checkpoint.all_steps(str(tmp_path / "checkpoints"))


def test_rerun_before_the_first_checkpoint_rewrites_metrics(tiny_run):
  """A run that died before saving anything starts over; its metrics rows are not kept
  (``tiny_run`` started on such a workdir)."""
  rows = metrics.read_jsonl(os.path.join(tiny_run, "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
  assert rows[0]["sft_loss"] != STALE_ROW["sft_loss"]


def test_rerun_of_finished_run_changes_nothing(tmp_path, tiny_run):
  shutil.copytree(tiny_run, tmp_path, dirs_exist_ok=True)
  before = _final_weights(str(tmp_path))
  n_rows = len(metrics.read_jsonl(str(tmp_path / "metrics.jsonl")))
  train.train(_config(), str(tmp_path), progress=False)
  _assert_same_weights(before, _final_weights(str(tmp_path)))
  assert len(metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))) == n_rows


# 8 groups: each device computes one in the update; only the final weights are compared
EIGHT_GROUPS = ["train.batch_groups=8", "train.checkpoint_every=0"]


def _flip_a_byte(step_dir):
  """Flips one byte in the middle of the step's largest file."""
  files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir) for f in fs]
  big = max(files, key=os.path.getsize)
  data = bytearray(open(big, "rb").read())
  data[len(data) // 2] ^= 0xFF
  open(big, "wb").write(bytes(data))


def test_a_workdir_with_no_whole_checkpoint_stops_and_keeps_its_metrics(tmp_path, tiny_run,
                                                                         capsys):
  """The newest save cut short, the others damaged: each is set aside with one line, and the
  run stops instead of training from step 0 over metrics.jsonl. With no checkpoint at all,
  the rows a fresh start replaces are named in a note."""
  workdir = tmp_path / "run"
  shutil.copytree(tiny_run, workdir)
  ckpts = workdir / "checkpoints"
  steps = checkpoint.all_steps(ckpts)
  os.remove(ckpts / str(steps[-1]) / "commit_success.txt")
  for step in steps[:-1]:
    _flip_a_byte(ckpts / str(step))
  before = (workdir / "metrics.jsonl").read_bytes()
  with pytest.raises(CheckpointCorruptError) as e:
    train.train(_config(), str(workdir), progress=False)
  assert str(e.value).startswith(f"no checkpoint in {ckpts} reads back whole (steps "
                                 f"{steps[-2::-1]} are set aside as <step>.damaged)")
  err = capsys.readouterr().err
  assert (f"checkpoint of step {steps[-1]} is incomplete (its save did not finish); kept as "
          f"{ckpts / str(steps[-1])}.damaged") in err
  assert (workdir / "metrics.jsonl").read_bytes() == before
  assert sorted(os.listdir(ckpts)) == sorted(f"{s}.damaged" for s in steps)
  s = train.build_setup(_config())
  with checkpoint.Checkpointer(ckpts) as ckpt:
    loop._start(s, ckpt, str(workdir / "metrics.jsonl"), train.abstract_state(s))
  rows = before.decode().count("\n")
  assert (f"note: no checkpoint in {ckpts}: training from step 0, in place of the {rows} rows "
          "metrics.jsonl holds") in capsys.readouterr().err


@pytest.fixture(scope="module")
def one_device_params(tmp_path_factory):
  """The final weights of the 8-group run on one device."""
  state = train.train(_config(["mesh.num_devices=1"] + EIGHT_GROUPS),
                      str(tmp_path_factory.mktemp("one")), progress=False)
  return jax.tree.map(np.asarray, state.params)


@pytest.mark.parametrize("sampler", [[], ["mesh.sampler_tensor=2"]],
                         ids=["fsdp", "tensor-parallel-sampler"])
def test_eight_devices_match_one(tmp_path, one_device_params, sampler):
  """FSDP over 8 devices == one device; also with the sampler on a mesh of its own that
  splits heads and MLP over 2 of them (``mesh.sampler_tensor``) while training stays FSDP."""
  eight = _config(["mesh.num_devices=8", "mesh.rules=fsdp"] + EIGHT_GROUPS + sampler)
  s8 = train.train(eight, str(tmp_path / "eight"), progress=False)
  assert len(s8.params["layers"]["q"].sharding.device_set) == 8
  assert [a for a in s8.params["layers"]["q"].sharding.spec if a] == ["fsdp"]  # still FSDP
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), b, atol=2e-5, rtol=1e-4),
               s8.params, one_device_params)


def test_partial_rollouts_train_and_resume_exactly(tmp_path):
  """APRIL in the trainer: held groups live in the checkpoint, so a resume is exact."""
  partial = ["rollout.partial=True", "rollout.max_staleness=1", "train.steps=4", "train.keep=10"]
  ref_dir = tmp_path / "ref"
  train.train(_config(partial), str(ref_dir), progress=False)
  rows = [r for r in metrics.read_jsonl(str(ref_dir / "metrics.jsonl")) if r["phase"] == "rl"]
  assert len(rows) == 4 and all(r["max_token_lag"] <= 1 for r in rows)
  assert any(r["off_policy_token_fraction"] > 0 for r in rows)  # carried-over groups used
  # resume from the first RL step's checkpoint, where the engine holds groups
  target = train.abstract_state(train.build_setup(_config(partial)), 4)  # the RL layout
  held, _ = checkpoint.restore(str(ref_dir / "checkpoints"), target, step=4)
  assert np.asarray(held.producer.held["valid"]).any()
  resumed = tmp_path / "resumed"
  stopped_at(ref_dir, resumed, 4)
  train.train(_config(partial), str(resumed), progress=False)
  _assert_same_weights(_final_weights(str(ref_dir)), _final_weights(str(resumed)))
  ref_rows = metrics.read_jsonl(str(ref_dir / "metrics.jsonl"))
  assert ([r.get("reward_mean") for r in metrics.read_jsonl(str(resumed / "metrics.jsonl"))]
          == [r.get("reward_mean") for r in ref_rows])


@pytest.mark.parametrize("overrides", [["mesh.num_devices=1"],
                                       ["mesh.num_devices=8", "mesh.rules=fsdp",
                                        "loss.preset=ppo"]])
def test_restore_target_matches_a_fresh_state(overrides):
  """The abstract restore target has the fresh state's structure, shapes, dtypes, layout."""
  setup = train.build_setup(_config(overrides))
  fresh, target = train.init_state(setup), train.abstract_state(setup)
  assert jax.tree.structure(fresh) == jax.tree.structure(target)
  for x, t in zip(jax.tree.leaves(fresh), jax.tree.leaves(target)):
    assert (x.shape, x.dtype) == (t.shape, t.dtype)
    assert x.sharding.is_equivalent_to(t.sharding, x.ndim), (x.sharding, t.sharding)


@pytest.mark.parametrize("preset", ["ppo", "vcpo"])
def test_critic_and_off_policy_presets_train(tmp_path, preset):
  """PPO (critic + GAE) and VCPO (OPOB baseline from per-row gradient norms) run end to end."""
  state = train.train(_config([f"loss.preset={preset}", "train.checkpoint_every=0"]),
                      str(tmp_path), progress=False)
  rows = [r for r in metrics.read_jsonl(str(tmp_path / "metrics.jsonl")) if r["phase"] == "rl"]
  assert len(rows) == 3 and all(np.isfinite(r["loss"]) for r in rows)
  if preset == "ppo":
    assert "vf_loss" in rows[0] and state.value_params
  else:
    assert 0 < rows[0]["ess_ratio"] <= 1.0 + 1e-6


def test_ppo_update_trains_the_critic():
  """Repeated PPO updates on one batch drive the critic's values toward the returns."""
  setup = train.build_setup(_config(["loss.preset=ppo", "optim.lr=3e-3"]))
  state = train.init_state(setup)
  layout = train.make_layout(setup)
  update = train.make_rl_update(setup, layout)
  G, M, R, P = 2, 4, 5, setup.prompt_len
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(3, 40, (G, M, R)), jnp.int32)
  prompts = jnp.asarray(rng.integers(3, 40, (G, P)), jnp.int32)
  lengths = jnp.full((G,), 4, jnp.int32)
  mask = jnp.ones((G, M, R), bool)
  old = train.make_logprob_fn(setup, layout)(state.params, prompts, lengths, tokens, mask)
  returns = jnp.asarray(rng.uniform(0.5, 1.0, (G, M, R)), jnp.float32)
  inputs = losses.ObjectiveInputs(rewards=jnp.zeros((G, M)), mask=mask, old_logp=old,
                                  behaviour_logp=old, values=returns - 0.1)
  # values 0.1 below the returns, so the value clip (0.2) does not bind
  r = train.UpdateBatch(prompts, lengths, tokens, inputs,
                        losses.Advantages(jnp.zeros((G, M, R)), returns=returns))
  carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
  vf = []
  for _ in range(10):
    *carry, mets = update(*carry, r)
    vf.append(float(mets["vf_loss"]))
  assert vf[-1] < 0.5 * vf[0], vf


def test_non_finite_loss_skips_update():
  setup = train.build_setup(_config())
  state = train.init_state(setup)
  layout = train.make_layout(setup)
  update = train.make_rl_update(setup, layout)
  G, M, R, P = 2, 4, 5, setup.prompt_len
  inputs = losses.ObjectiveInputs(
      rewards=jnp.zeros((G, M)), mask=jnp.ones((G, M, R), bool),
      old_logp=jnp.full((G, M, R), -1.0), behaviour_logp=jnp.full((G, M, R), -1.0))
  r = train.UpdateBatch(jnp.ones((G, P), jnp.int32), jnp.full((G,), 3, jnp.int32),
                        jnp.ones((G, M, R), jnp.int32), inputs,
                        losses.Advantages(jnp.full((G, M), jnp.nan)))
  before = jax.tree.map(np.asarray, state.params)
  fresh = lambda: (jax.tree.map(jnp.copy, state.params), jax.tree.map(jnp.copy, state.opt_state),
                   {}, {})
  params, _, _, _, mets = update(*fresh(), r)
  assert int(mets["update_skipped"]) == 1
  jax.tree.map(np.testing.assert_array_equal, before, jax.tree.map(np.asarray, params))
  r = r._replace(advantages=losses.Advantages(jnp.ones((G, M))))
  params, _, _, _, mets = update(*fresh(), r)
  assert int(mets["update_skipped"]) == 0
  assert not np.array_equal(before["embed"], np.asarray(params["embed"]))


@pytest.mark.slow  # a training run; the skip itself: test_non_finite_loss_skips_update
def test_consecutive_skipped_updates_stop_the_run_with_every_row_written(tmp_path):
  """A learning rate that blows the weights up after the first update: the next updates are
  skipped, and after ``train.max_bad_steps`` of them the run stops in one line that names the
  last step as metrics.jsonl numbers it, with that step's row written too."""
  config = _config(["sft.steps=0", "train.steps=6", "optim.lr=1e30", "loss.entropy_coef=0.1",
                    "train.max_bad_steps=2", "train.checkpoint_every=0"])
  with pytest.raises(RLJaxError) as e:
    train.train(config, str(tmp_path), progress=False)
  assert str(e.value).startswith("2 consecutive steps had a non-finite loss or gradient norm "
                                 "(the last is step 3 of metrics.jsonl); stopping")
  rows = metrics.read_jsonl(str(tmp_path / "metrics.jsonl"))
  assert [(r["step"], r["update_skipped"]) for r in rows] == [(1, 0.0), (2, 1.0), (3, 1.0)]


@pytest.mark.parametrize("override,message", [
    ("--config.loss.preset=grpoo", "loss.preset"),
    ("--config.rollout.nn=3", "rollout.nn"),
    ("--config.data.task=nosuchtask", "nosuchtask"),
    ("--config.rollout.n=0", "rollout.n"),
    ("--config.rollout.over_sampling=0.5", "rollout.over_sampling"),
    ("--config.rollout.max_staleness=-2", "rollout.max_staleness"),
    ("--config.loss.advantage=nosuch", "loss.advantage"),
    ("--config.loss.m2po_tau=-1", "loss.m2po_tau"),
    ("--config.train.minibatches=3", "minibatches"),
    ("--config.rollout.max_new_tokens=5000", "max_new_tokens"),
    # values that trained on NaN or silently flipped a term before they were checked
    ("--config.mesh.shape.data=0", "mesh.shape must give each axis an int >= 1, or -1"),
    ("--config.mesh.shape.data=-2", "mesh.shape must give each axis an int >= 1, or -1"),
    ("--config.env.invalid_reward=nan", "env.invalid_reward must be a finite number"),
    ("--config.optim.b1=nan", "optim.b1"),
    ("--config.optim.eps=0.0", "optim.eps"),
    ("--config.loss.adv_eps=0.0", "loss.adv_eps"),
    ("--config.loss.ace_alpha=-5.0", "loss.ace_alpha"),
    ("--config.loss.value_coef=0.5", "value_coef=0.5 trains a critic on the returns of GAE"),
])
def test_bad_config_fails_in_one_line(tmp_path, override, message, capsys):
  """The command's entry point (run in this process; the subprocess test below runs the
  command itself once) exits with 2 and one ``error:`` line."""
  with pytest.raises(SystemExit) as e:
    train.main(["rl_jax.train", f"--config={QUICKSTART}", f"--workdir={tmp_path}", override])
  assert e.value.code == 2
  stderr = capsys.readouterr().err
  lines = [l for l in stderr.strip().splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and message in lines[0], stderr
  assert "Traceback" not in stderr


def test_bad_config_command_fails_in_one_line(tmp_path):
  proc = subprocess.run(
      [sys.executable, "-m", "rl_jax.train", f"--config={QUICKSTART}",
       f"--workdir={tmp_path}", "--config.rollout.nn=3"], cwd=ROOT, capture_output=True,
      text=True, timeout=300)
  assert proc.returncode == 2
  lines = [l for l in proc.stderr.strip().splitlines() if l.startswith("error:")]
  assert len(lines) == 1 and "rollout.nn" in lines[0], proc.stderr
  assert "Traceback" not in proc.stderr


def test_missing_data_file_fails_before_compiling(tmp_path):
  config = _config(["data.task=file", f"data.path={tmp_path / 'missing.jsonl'}"])
  with pytest.raises(Exception, match="missing.jsonl"):
    train.build_setup(config)


@pytest.mark.parametrize("overrides,line", [
    (["data.path=/data/train.jsonl"], "data.path='/data/train.jsonl' is read only by "
     "data.task='file', not by data.task='sorting': set --config.data.task=file"),
    (["data.eval_path=/data/eval.jsonl"], "data.eval_path='/data/eval.jsonl' is read only by"),
    (["rollout.eos_id=100000"], "config.rollout.eos_id=100000 is outside the model's "
     "vocabulary [0, "),
    (["data.template=Q: {question}"], "data.template='Q: {question}' is read only by "
     "data.task='file', not by data.task='sorting'"),
    (["data.format=math"], "data.format='math' is read only by data.task='file'"),
    (["loss.preset=mc_grpo", "rollout.n=1"], "rollout.n=1: MC-GRPO's advantages"),
    (["optim.schedule=cosine", "optim.warmup_steps=6", "train.minibatches=2"],
     "optim.warmup_steps=6 leaves nothing of the RL stage's 6 optimizer updates"),
    (["optim.schedule=cosine", "optim.warmup_steps=3", "train.steps=4"],
     "optim.warmup_steps=3 leaves nothing of the supervised stage's 3 optimizer updates"),
])
def test_settings_the_run_would_ignore_or_break_on_are_one_error(overrides, line):
  """A data file given to a built-in task would be silently unused; an EOS id outside the
  vocabulary would fail inside the sampler without naming the setting."""
  with pytest.raises(ConfigError) as e:
    train.build_setup(_config(overrides))
  assert str(e.value).startswith(line) and "\n" not in str(e.value)


def test_the_longest_prompt_allowed_is_data_max_prompt_len():
  """A prompt of exactly ``data.max_prompt_len`` tokens is allowed (its doc's word); one
  more is an error naming the prompt."""
  longest = train.build_setup(_config()).prompt_len - 1  # P: the longest prompt + 1
  assert train.build_setup(_config([f"data.max_prompt_len={longest}"])).prompt_len == longest + 1
  with pytest.raises(ConfigError) as e:
    train.build_setup(_config([f"data.max_prompt_len={longest - 1}"]))
  assert re.fullmatch(rf"data: (train|eval) prompt \d+ has {longest} tokens > "
                      rf"data.max_prompt_len={longest - 1} \(the longest prompt allowed\)",
                      str(e.value))


def test_a_file_without_held_out_prompts_needs_them_only_to_evaluate(tmp_path):
  """A file whose few questions all hash into the train split trains without evaluation;
  with evaluation it is one line that says what to set."""
  questions = [q for q in (f"What is {i} plus 1?" for i in range(40))
               if split_of(q, 0.05) == "train"][:3]
  path = tmp_path / "few.jsonl"
  path.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n"
                          for q in questions))
  data = ["data.task=file", f"data.path={path}", "data.format=gsm8k"]
  assert len(train.build_setup(_config(data)).train_examples) == 3  # train.eval_every=0
  with pytest.raises(ConfigError) as e:
    train.build_setup(_config(data + ["train.eval_every=1"]))
  assert str(e.value) == (f"data: {path} leaves no held-out prompts (a hash of each prompt "
                          "puts about 1 in 20 in the eval split): set data.eval_path to a "
                          "held-out file, or train.eval_every=0")


def test_a_character_the_char_tokenizer_lacks_names_the_prompt_and_the_tokenizer(tmp_path):
  path = tmp_path / "cafe.jsonl"
  path.write_text(json.dumps({"question": "1 café plus 1?", "answer": "#### 2"}) + "\n")
  with pytest.raises(DataError) as e:
    train.build_setup(_config(["data.task=file", f"data.path={path}", f"data.eval_path={path}",
                               "data.format=gsm8k"]))
  assert str(e.value) == ("data: train prompt 0: character 'é' at position 5 is not in the "
                          "char tokenizer vocabulary (the character tokenizer: model.hf_path "
                          "and data.tokenizer are unset)")


def test_a_warm_up_longer_than_its_stage_gets_a_note():
  """A constant schedule whose warm-up outlasts the stage never reaches ``optim.lr``."""
  notes = config_lib.notices(_config(["optim.warmup_steps=8", "train.minibatches=2"]))
  assert notes == ["note: optim.warmup_steps=8 is longer than the RL stage's 6 optimizer "
                   "updates: its learning rate reaches only 0.75 of its peak",
                   "note: optim.warmup_steps=8 is longer than the supervised stage's 3 "
                   "optimizer updates: its learning rate reaches only 0.38 of its peak"]
  assert config_lib.notices(_config(["optim.warmup_steps=3"])) == []


def test_turn_level_estimator_is_rejected_without_multi_turn_rollouts():
  """GiGPO reads per-turn fields that single-turn rollouts do not produce: one clear error."""
  with pytest.raises(Exception, match="turn_"):
    train.build_setup(_config(["loss.advantage=gigpo"]))
