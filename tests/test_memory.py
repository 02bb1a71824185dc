"""Memory: no dead state (supervised optimizer state, reference), checkpoints of an earlier
state layout fail in one line, the memory plan predicts the state's bytes exactly, the dry
run reads no weights, and a run that cannot fit fails in one line."""

import functools
import json
import shutil
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import checkpoint, config_utils, metrics, train
from rl_jax.errors import CheckpointError
from rl_jax.train import memory, resume, topology
from tests.hf_utils import tiny_hf_model
from tests.test_train_hf import QUESTIONS, _write_tokenizer
from tests.tiny import QUICKSTART, ROOT, TINY_MODEL, env_with_devices

TINY = TINY_MODEL + [
    "sft.batch_size=8", "train.steps=2", "train.batch_groups=4", "rollout.n=4",
    "train.eval_every=0", "train.checkpoint_every=1", "train.keep=10", "log.tensorboard=False",
]


def _config(overrides=()):
  return config_utils.load_config(QUICKSTART, list(TINY) + list(overrides))


def _parts(saved):
  return {p.split("/", 1)[0] for p in saved}


def test_no_supervised_optimizer_state_with_sft_steps_zero(tmp_path):
  """sft.steps=0: never allocated nor checkpointed; the bf16 reference is saved in bf16; the
  plan's state bytes equal the live state's."""
  config = _config(["sft.steps=0", "loss.kl_beta=0.01", "model.dtype=bfloat16"])
  s = train.build_setup(config)
  assert train.init_state(s).sft_opt_state == {}
  assert train.abstract_state(s).sft_opt_state == {}
  train.train(config, str(tmp_path), progress=False)
  ckpts = str(tmp_path / "checkpoints")
  assert checkpoint.all_steps(ckpts) == [1, 2]
  for step in (1, 2):
    saved = checkpoint.saved_leaves(ckpts, step)
    assert "sft_opt_state" not in _parts(saved) and "ref_params" in _parts(saved)
    assert {v["dtype"] for p, v in saved.items() if p.startswith("ref_params/")} == {"bfloat16"}
  plan = json.load(open(tmp_path / memory.PLAN_FILE))
  assert "sft" not in plan["state"] and plan["state"]["rl"]["sft_optimizer"] == 0
  live = plan["live_state"]
  assert all(live[k] == v for k, v in plan["state"]["rl"].items() if k != "sampler_copy")


def test_supervised_state_is_dropped_when_rl_starts():
  """The layout by step: supervised optimizer state up to (and in the checkpoint of) step
  sft.steps, the reference from the first RL step; ``begin_rl`` switches a real state."""
  s = train.build_setup(_config(["sft.steps=2", "loss.kl_beta=0.01"]))
  for step, rl in ((0, False), (2, False), (3, True), (9, True)):
    a = train.abstract_state(s, step)
    assert bool(jax.tree.leaves(a.sft_opt_state)) != rl and bool(a.ref_params) == rl, step
  state = train.init_state(s)
  assert jax.tree.leaves(state.sft_opt_state) and state.ref_params == {}
  state = train.begin_rl(s, state)
  assert state.sft_opt_state == {}
  for r, p in zip(jax.tree.leaves(state.ref_params), jax.tree.leaves(state.params)):
    assert r.dtype == p.dtype  # a copy: the update donates the policy
    ptr = lambda x: x.addressable_shards[0].data.unsafe_buffer_pointer()
    assert ptr(r) != ptr(p)
    np.testing.assert_array_equal(np.asarray(r), np.asarray(p))
  target = train.abstract_state(s, 3)
  assert jax.tree.structure(state) == jax.tree.structure(target)


EARLIER = "was written in an earlier state layout that this version of rl_jax no longer reads"
ADVICE = "resume it with the rl_jax version that wrote it, or start a new workdir"


def _one_line(err, step) -> str:
  """The error's message, checked to be one line about the checkpoint of ``step``."""
  msg = str(err.value)
  assert "\n" not in msg and f"the checkpoint of step {step} " in msg, msg
  return msg


@pytest.mark.parametrize("sft_steps,step", [(0, 2), (3, 1)])
def test_checkpoint_keeping_both_optional_parts_fails_in_one_line(tmp_path, sft_steps, step):
  """The layout before ``rl_layout`` kept the supervised optimizer state all run next to an
  f32 reference: restoring it fails before any array is read, in one line that names the part
  the run no longer keeps at that step."""
  s = train.build_setup(_config([f"sft.steps={sft_steps}", "loss.kl_beta=0.01"]))
  new = train.init_state(s)
  old = new._replace(sft_opt_state=jax.jit(s.optimizers.sft.init)(new.params),
                     ref_params=jax.tree.map(jnp.copy, new.params))
  with checkpoint.Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.save(step, old._replace(step=jnp.asarray(step, jnp.int32)))
    with pytest.raises(CheckpointError) as err:
      resume.restore_state(s, ckpt, step, train.abstract_state(s, step))
  msg = _one_line(err, step)
  dropped = "sft_opt_state" if sft_steps == 0 else "ref_params"
  assert EARLIER in msg and ADVICE in msg and f"no longer keeps {dropped} at" in msg, msg


def test_checkpoint_with_a_part_the_config_drops_names_the_config(tmp_path):
  """A current checkpoint holding a part the config does not keep at that step (here the
  reference, after the KL term was switched off) is no earlier layout: the line says so."""
  s = train.build_setup(_config(["sft.steps=0", "loss.kl_beta=0.01"]))
  other = train.build_setup(_config(["sft.steps=0", "loss.kl_beta=0.0"]))
  assert train.abstract_state(other, 1).ref_params == {}
  with checkpoint.Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.save(1, train.init_state(s)._replace(step=jnp.asarray(1, jnp.int32)))
    with pytest.raises(CheckpointError) as err:
      resume.restore_state(other, ckpt, 1, train.abstract_state(other, 1))
  msg = _one_line(err, 1)
  assert "holds ref_params, which this config does not keep" in msg and EARLIER not in msg


@pytest.mark.parametrize("overrides", [["sft.steps=2"], ["loss.preset=ppo", "sft.steps=0"]])
def test_plan_predicts_the_state_bytes_on_eight_devices(overrides):
  """Shard bytes from abstract shapes == the bytes the placed arrays hold on device 0,
  checked independently from each shard's buffer."""
  s = train.build_setup(_config(["mesh.num_devices=8", "mesh.rules=fsdp"] + overrides))
  state = train.init_state(s)
  predicted = memory.state_parts(train.abstract_state(s))
  dev = jax.devices()[0]
  def field(path):  # "producer.held" -> state.producer.held
    return functools.reduce(getattr, path.split("."), state)

  held = {part: sum(sh.data.nbytes for f in fields for x in jax.tree.leaves(field(f))
                    for sh in x.addressable_shards if sh.device == dev)
          for part, fields in memory.PARTS.items()}
  assert {k: v for k, v in predicted.items() if k in held} == held
  everything = sum(sh.data.nbytes for x in jax.tree.leaves(state) for sh in x.addressable_shards
                   if sh.device == dev)
  assert sum(predicted.values()) == everything  # the parts cover the whole state
  total = sum(x.nbytes for x in jax.tree.leaves(state.params))
  assert total / 8 <= predicted["policy"] < total / 2  # sharded, not replicated


def test_run_that_cannot_fit_fails_in_one_line(tmp_path):
  huge = ["model.hidden_size=16384", "model.intermediate_size=65536", "model.num_layers=64",
          "model.num_heads=128", "model.num_kv_heads=8", "model.head_dim=128",
          "mesh.num_devices=1"]
  t0 = time.perf_counter()
  with pytest.raises(memory.MemoryPlanError) as e:
    train.train(_config(huge), str(tmp_path), progress=False)
  msg = str(e.value)
  assert "\n" not in msg and "rl_optimizer" in msg and "optim.mu_dtype=bfloat16" in msg, msg
  assert not (tmp_path / "checkpoints" / "0").exists()
  assert time.perf_counter() - t0 < 60


def test_dry_run_prints_the_plan_for_eight_devices_without_reading_weights(tmp_path):
  model_dir, data = tmp_path / "model", tmp_path / "train.jsonl"
  model_dir.mkdir()
  with open(data, "w") as f:
    for i, (q, a) in enumerate(QUESTIONS * 8):  # enough rows for the hashed eval split
      f.write(json.dumps({"question": f"{q} (#{i})", "answer": a}) + "\n")
  vocab = _write_tokenizer(str(model_dir), [q + " " + a for q, a in QUESTIONS])
  tiny_hf_model("qwen3", model_dir, vocab=vocab, hidden=64, inter=128, layers=2, heads=4,
                kv_heads=2, head_dim=16, max_pos=512)
  for f in model_dir.glob("*.safetensors"):
    f.write_bytes(b"corrupt")  # any read of the weights fails
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={ROOT}/configs/gsm8k_hf.py",
         f"--workdir={tmp_path / 'run'}", f"--config.model.hf_path={model_dir}",
         f"--config.data.path={data}", "--config.data.max_prompt_len=128",
         "--config.rollout.max_new_tokens=8", "--config.rollout.n=2",
         "--config.train.batch_groups=8", "--config.train.minibatches=1",
         "--config.train.eval_every=0", "--config.train.dry_run=True"]
  env = env_with_devices(8)
  t0 = time.perf_counter()
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  took = time.perf_counter() - t0
  assert out.returncode == 0, out.stderr[-2000:]
  assert "memory plan: 8 cpu device(s)" in out.stdout and "step rl_update" in out.stdout
  plan = json.load(open(tmp_path / "run" / memory.PLAN_FILE))
  embeddings = 2 * vocab * 64  # untied embed + lm_head, f32 master weights, sharded over 8
  assert 4 * embeddings // 8 <= plan["state"]["rl"]["policy"] < 4 * embeddings // 2
  assert plan["state"]["rl"]["rl_optimizer"] >= 2 * plan["state"]["rl"]["policy"]
  assert plan["state"]["rl"]["reference"] * 2 == plan["state"]["rl"]["policy"]  # bf16
  assert not (tmp_path / "run" / "metrics.jsonl").exists()
  assert took < 120, took


# Per-knob learning: one shared baseline runs the quickstart's supervised stage (25 steps)
# and a short RL stage; every knob resumes from the baseline's checkpoint of the supervised
# stage's last step and trains the same RL steps with that knob on. Rollouts at temperature
# 0.25 (the supervised policy then earns ~0.25 reward, so the reward rises within a few
# steps); programs shared by the runs load from one compilation cache.
KNOB_RUN = ["mesh.num_devices=1", "train.steps=12", "train.batch_groups=32",
            "rollout.temperature=0.25", "optim.lr=5e-4", "loss.kl_beta=0.001",
            "train.eval_every=0", "train.checkpoint_every=25", "train.keep=10",
            "log.tensorboard=False", "eval.pass_k=0"]
# Offload and remat change no arithmetic (tests/test_offload.py, test_models.py), so the runs
# here are the knobs that change the numbers: a bfloat16 policy (with and without stochastic
# rounding), and bfloat16 first moments with a bfloat16 reference.
KNOB_TESTS = {
    "model.param_dtype=bfloat16": ["model.param_dtype=bfloat16"],
    "model.param_dtype=bfloat16 + optim.stochastic_rounding": [
        "model.param_dtype=bfloat16", "optim.stochastic_rounding=True"],
    "optim.mu_dtype=bfloat16 + train.ref_dtype=bfloat16": [
        "optim.mu_dtype=bfloat16", "train.ref_dtype=bfloat16"],
}


def _rl_rewards(workdir) -> list[float]:
  return [r["reward_mean"] for r in metrics.read_jsonl(str(workdir / "metrics.jsonl"))
          if r["phase"] == "rl"]


def _knob_config(cache, extra=()):
  return config_utils.load_config(QUICKSTART, KNOB_RUN + [f"train.compile_cache={cache}"]
                                  + list(extra))


@pytest.fixture(scope="module")
def knob_baseline(tmp_path_factory):
  """(workdir, cache, RL rewards, final state) of the defaults: float32 everything, f32
  reference, no offload, ``model.remat`` of the quickstart."""
  root = tmp_path_factory.mktemp("knobs")
  cache, run = root / "cache", root / "baseline"
  state = train.train(_knob_config(cache), str(run), progress=False)
  return run, cache, _rl_rewards(run), state


def _rises(rewards, k=4) -> tuple[float, float]:
  return float(np.mean(rewards[:k])), float(np.mean(rewards[-k:]))


def test_knob_baseline_learns(knob_baseline):
  first, last = _rises(knob_baseline[2])
  assert last > first + 0.05, (first, last)  # about 0.25 -> 0.40; flat without learning


@pytest.mark.parametrize("knob", sorted(KNOB_TESTS))
def test_memory_knob_still_learns(knob_baseline, knob, tmp_path):
  """From the baseline's supervised checkpoint, the RL stage with ``knob`` still raises the
  training reward, to within 0.1 of the baseline's; the knob really changed the state."""
  base_run, cache, base_rewards, _ = knob_baseline
  sft = config_utils.load_config(QUICKSTART, []).sft.steps
  shutil.copytree(base_run / "checkpoints" / str(sft), tmp_path / "checkpoints" / str(sft))
  config = _knob_config(cache, KNOB_TESTS[knob])
  state = train.train(config, str(tmp_path), progress=False)
  rewards = _rl_rewards(tmp_path)
  assert len(rewards) == len(base_rewards)
  first, last = _rises(rewards)
  assert last > first + 0.05 and last > _rises(base_rewards)[1] - 0.1, (first, last)
  leaves = lambda tree: jax.tree.leaves(tree)
  n_params = sum(x.size for x in leaves(state.params))
  dtypes = lambda tree: {x.dtype for x in leaves(tree)}
  if knob.startswith("optim.mu_dtype"):  # the first moment; the second stays float32
    assert sum(x.size for x in leaves(state.opt_state) if x.dtype == jnp.bfloat16) == n_params
    assert dtypes(state.ref_params) == {jnp.dtype(jnp.bfloat16)}
  else:
    assert dtypes(state.params) == {jnp.dtype(jnp.bfloat16)}
  plan = json.load(open(tmp_path / memory.PLAN_FILE))
  assert plan["live_state"]["step"] == sft  # resumed from the baseline's checkpoint


def test_checkpoints_before_producer_state_fail_in_one_line(tmp_path, capsys):
  """Checkpoints written before ``ProducerState`` (the producer's fields flat at the top:
  data, rollout_buffer, selector, spec_drafts) and an asynchronous queue whose stats have
  fewer columns (an earlier counter list) are not read: one ``CheckpointError`` line each;
  ``restore_newest`` stops there (nothing set aside) and the CLI prints it as ``error:``."""
  s = train.build_setup(_config(["sft.steps=0", "data.selector=greso", "train.mode=async",
                                 "train.async_lag=1"]))
  new = train.init_state(s)
  p = new.producer
  flat = {f: getattr(new, f) for f in new._fields if f != "producer"}
  flat.update(data=p.data, rollout_buffer=p.held, selector=p.selector, spec_drafts=p.drafts)
  columns = new.rollout_queue["stats"].shape[1]
  queue = dict(jax.device_get(new.rollout_queue))
  queue["stats"] = queue["stats"][:, :-3]
  with checkpoint.Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.save(1, dict(flat, step=jnp.asarray(1, jnp.int32)))
    ckpt.save(2, new._replace(step=jnp.asarray(2, jnp.int32), rollout_queue=queue))
    ckpt.wait()
    with pytest.raises(CheckpointError) as err:
      resume.restore_state(s, ckpt, 1, train.abstract_state(s, 1))
    msg = _one_line(err, 1)
    assert EARLIER in msg and ADVICE in msg and "the producer's fields (data, " in msg, msg
    with pytest.raises(SystemExit):
      config_utils.main_guard(resume.restore_newest)(s, ckpt, train.abstract_state(s))
  assert checkpoint.all_steps(str(tmp_path)) == [1, 2]
  err = capsys.readouterr().err
  assert err.startswith("error: the checkpoint of step 2 ") and err.count("\n") == 1, err
  assert EARLIER in err and f"stats have {columns - 3} columns" in err, err


def test_lora_checkpoint_with_full_params_fails_in_one_line(tmp_path):
  """LoRA checkpoints written before adapter-only checkpoints (``lora_checkpoint``) hold the
  frozen base in ``params`` as well: one ``CheckpointError`` line."""
  s = train.build_setup(_config(["sft.steps=0", "model.lora.rank=4", "model.lora.targets=q,v"]))
  with checkpoint.Checkpointer(str(tmp_path), save_every=1) as ckpt:
    ckpt.save(1, train.init_state(s)._replace(step=jnp.asarray(1, jnp.int32)))
    with pytest.raises(CheckpointError) as err:
      resume.restore_state(s, ckpt, 1, train.abstract_state(s, 1))
  msg = _one_line(err, 1)
  assert EARLIER in msg and ADVICE in msg and "frozen LoRA base besides the adapters" in msg


def test_a_run_whose_update_calls_do_not_split_over_the_batch_devices_says_so(tmp_path,
                                                                              capsys):
  """4 groups per update call on the 8-device FSDP mesh: the run's start prints one note
  (``topology.update_split_note``) naming a batch that splits; 8 groups make none."""
  config = lambda groups: config_utils.load_config(QUICKSTART, TINY_MODEL + [
      "mesh.num_devices=8", "mesh.rules=fsdp", "sft.steps=0", f"train.batch_groups={groups}",
      "train.dry_run=True", "log.tensorboard=False"])
  assert topology.update_split_note(train.build_setup(config(8))) is None
  assert train.train(config(4), str(tmp_path), progress=False) is None
  notes = [line for line in capsys.readouterr().err.splitlines() if "do not split over" in line]
  assert len(notes) == 1 and notes[0].startswith(
      "note: each update call's 4 groups do not split over the 8 chips"), notes
  assert notes[0].endswith("a train.batch_groups that is a multiple of 8 splits them")
