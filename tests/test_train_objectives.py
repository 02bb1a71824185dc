"""The trainer's objective contract: every preset and every advantage estimator trains (or is
rejected at config time in one line), the input record holds exactly what the objective
declares it needs, and an estimator registered from outside rl_jax trains through
``python -m rl_jax.train`` without touching the trainer."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config_utils, losses, models, train
from rl_jax.errors import ConfigError
from tests.tiny import QUICKSTART, TINY_MODEL, ParityTask

TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=2", "train.batch_groups=2", "rollout.n=4",
    "rollout.temperature=1.0", "train.eval_every=0", "log.tensorboard=False",
]
BUILTIN_ADVANTAGES = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline",
                      "mc_grpo", "gae", "gdpo", "opob")


def _setup(overrides):
  return train.build_setup(config_utils.load_config(QUICKSTART, TINY + list(overrides)))


def _parity_setup(overrides):
  setup = _setup(overrides)
  return dataclasses.replace(setup, task=ParityTask(setup.task))


def _two_rl_steps(setup):
  t = train.make_trainer(setup)
  state = train.init_state(setup)
  state = train.begin_rl(setup, state)
  before = jax.tree.map(np.asarray, state.params)
  records = []
  for _ in range(2):
    state, record, data = train.rl_step(t, state)
    state = state._replace(step=state.step + 1, data=jnp.asarray(data))
    records.append(record)
  return before, state, records


def test_builtin_advantages_are_all_registered():
  assert set(BUILTIN_ADVANTAGES) <= set(losses.advantage_names())


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  """A tiny random Qwen3 of the character vocabulary: on-policy distillation's teacher."""
  from rl_jax.data import tokenizers  # pylint: disable=import-outside-toplevel
  from tests.hf_utils import tiny_hf_model  # pylint: disable=import-outside-toplevel
  path = tmp_path_factory.mktemp("teacher")
  tiny_hf_model("qwen3", path, vocab=tokenizers.CharTokenizer().vocab_size, hidden=32,
                inter=64, layers=1, max_pos=64)
  return str(path)


def _check_ppo(state, records):
  """PPO trains a critic: value params, and its loss in every step's metrics."""
  assert jax.tree.leaves(state.value_params)
  assert all(np.isfinite(r["vf_loss"]) for r in records)


def _check_vcpo(state, records):
  """VCPO's OPOB weights give an effective sample size ratio in (0, 1] each step."""
  del state
  assert all(0 < r["ess_ratio"] <= 1.0 + 1e-6 for r in records)


PRESET_CHECKS = {"ppo": _check_ppo, "vcpo": _check_vcpo}


# An estimator some preset trains with (its "preset-" case) runs as an "advantage-" case (the
# quickstart's grpo preset with it) only with -m slow.
PRESET_ADVANTAGES = {p.get("advantage", "grpo") for p in losses.PRESETS.values()}


def _objective_case(kind, name):
  slow = kind == "advantage" and name in PRESET_ADVANTAGES
  return pytest.param(kind, name, id=f"{kind}-{name}", marks=pytest.mark.slow if slow else ())


@pytest.mark.parametrize("kind,name", (
    [_objective_case("preset", p) for p in sorted(losses.PRESETS)]
    + [_objective_case("advantage", a) for a in BUILTIN_ADVANTAGES]
    + [_objective_case("knob", "entropy_coef=0.01")]))
def test_every_preset_and_advantage_trains(kind, name, teacher_dir):
  """Two RL steps of each objective: finite losses, no skipped update, the policy moves (and
  the preset's own metrics and state, ``PRESET_CHECKS``)."""
  overrides = [{"preset": f"loss.preset={name}", "advantage": f"loss.advantage={name}",
                "knob": f"loss.{name}"}[kind]]
  if name == "on_policy_distill":  # the preset's advantages are the teacher's
    overrides.append(f"distill.teacher_path={teacher_dir}")
  before, state, records = _two_rl_steps(_parity_setup(overrides))
  for r in records:
    assert np.isfinite(r["loss"]) and r["update_skipped"] == 0, r
  moved = [not np.array_equal(a, np.asarray(b))
           for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params))]
  assert any(moved), "two RL steps left the policy unchanged"
  if kind == "preset" and name in PRESET_CHECKS:
    PRESET_CHECKS[name](state, records)


def test_objective_needing_what_the_trainer_lacks_is_rejected_in_one_line():
  """A custom policy stage that reads an input no trainer stage computes fails at setup."""
  def costs_stage(knobs):
    del knobs
    return losses.LossStage(lambda terms, x: terms, "policy", needs=("token_costs",))

  losses.register_policy("needs_token_costs", costs_stage, overwrite=True)
  with pytest.raises(ConfigError, match="token_costs") as e:
    _setup(["loss.policy=needs_token_costs"])
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,needed", [
    (["loss.preset=grpo", "loss.kl_beta=0.01"], {"ref_logp"}),
    (["loss.preset=ppo"], {"values"}),
    (["loss.preset=vcpo"], {"grad_sq_norms"}),
    (["loss.preset=reinforce_pp_baseline"], {"lengths"}),
    (["loss.advantage=gdpo"], {"reward_components"}),
])
def test_inputs_hold_exactly_what_the_objective_needs(overrides, needed):
  """Declared fields are filled (and equal an independent computation); optional fields the
  objective does not declare stay None, so no pass runs for them."""
  setup = _setup(overrides)
  assert needed <= setup.objective.needs
  t = train.make_trainer(setup)
  state = train.begin_rl(setup, train.init_state(setup))
  batch, _, _ = train.collect(t, state)
  x = batch.inputs
  G, M, R = batch.tokens.shape
  optional = {"ref_logp", "values", "grad_sq_norms", "reward_components", "lengths"}
  for field in optional:
    assert (getattr(x, field) is not None) == (field in setup.objective.needs), field
  args = (batch.prompt_tokens, batch.prompt_lengths, batch.tokens, x.mask)
  cfg, temp = setup.model_cfg, setup.rollout.temperature
  if "ref_logp" in needed:
    ref = models.response_logprobs(cfg, state.ref_params, *args, shared_prefix=False,
                                   temperature=temp)
    chex.assert_trees_all_close(x.ref_logp, ref, atol=1e-5)
  if "values" in needed:
    values = models.response_values(cfg, state.value_params, *args, shared_prefix=False)
    chex.assert_trees_all_close(x.values, values, atol=1e-5)
  if "lengths" in needed:
    chex.assert_trees_all_close(x.lengths, np.asarray(x.mask).sum(-1).astype(np.float32))
  if "reward_components" in needed:
    chex.assert_shape(x.reward_components, (G, M, 1))
    chex.assert_trees_all_close(x.reward_components[..., 0], x.rewards)
  if "grad_sq_norms" in needed:  # one plain jax.grad per trajectory (one program for all)
    @jax.jit
    def one_grad(p, prompt, plen, tokens, mask):
      def f(p):
        return models.response_logprobs(cfg, p, prompt, plen, tokens, mask,
                                        shared_prefix=False, temperature=temp).sum()
      return sum(jnp.sum(l ** 2) for l in jax.tree.leaves(jax.grad(f)(p)))

    def row_sq_norm(g, m):
      return float(one_grad(state.params, batch.prompt_tokens[g:g + 1],
                            batch.prompt_lengths[g:g + 1], batch.tokens[g:g + 1, m:m + 1],
                            x.mask[g:g + 1, m:m + 1]))
    want = np.asarray([[row_sq_norm(g, m) for m in range(M)] for g in range(G)])
    np.testing.assert_allclose(np.asarray(x.grad_sq_norms), want, rtol=1e-4)


CUSTOM_CONFIG = '''
import json, os
import jax.numpy as jnp
from rl_jax import losses
from rl_jax import config as base

LOG = os.environ["RLJAX_TEST_LOG"]

def _centered(knobs):
  def compute(x):
    with open(LOG, "a") as f:
      f.write(json.dumps({{"rewards": list(x.rewards.shape), "mask": list(x.mask.shape)}}) + "\\n")
    return losses.Advantages(x.rewards - jnp.mean(x.rewards, axis=1, keepdims=True))
  return losses.AdvantageEstimator(compute, "centered", ())

losses.register_advantage("centered", _centered, overwrite=True)

def get_config(arg=None):
  config = base.base_config()
  config.model.update(architecture="qwen3", hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=64)
  config.data.update(task="sorting", max_prompt_len=24)
  config.rollout.update(n=4, max_new_tokens=5)
  config.loss.update(preset="grpo", advantage="centered")
  config.train.update(steps={steps}, batch_groups=2, eval_every=0, checkpoint_every=0)
  config.log.tensorboard = False
  return config
'''


def test_estimator_registered_outside_rl_jax_trains_end_to_end(tmp_path):
  steps = 3
  cfg = tmp_path / "custom.py"
  cfg.write_text(textwrap.dedent(CUSTOM_CONFIG.format(steps=steps)))
  log = tmp_path / "calls.jsonl"
  proc = subprocess.run(
      [sys.executable, "-m", "rl_jax.train", f"--config={cfg}", f"--workdir={tmp_path / 'run'}"],
      cwd=str(tmp_path), capture_output=True, text=True, timeout=600,
      env={**os.environ, "RLJAX_TEST_LOG": str(log)})
  assert proc.returncode == 0, proc.stderr[-3000:]
  calls = [json.loads(l) for l in log.read_text().splitlines()]
  # the estimator runs jitted: traced once (the memory plan's shapes-only pass and the
  # trainer's compile share the trace), then no step traces it again
  assert calls == [{"rewards": [2, 4], "mask": [2, 4, 5]}]
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    rows = [json.loads(l) for l in f]
  assert [r["step"] for r in rows] == list(range(1, steps + 1))
  assert all(np.isfinite(r["loss"]) for r in rows)
  assert os.path.exists(tmp_path / "run" / "hf" / "model.safetensors")


def test_update_trims_the_host_heap_only_for_policies_past_the_threshold(monkeypatch):
  """``apply_update`` hands freed host memory back before the update for a large policy and
  skips it for a small one (where re-touching the trimmed pages costs more than it saves)."""
  from rl_jax.train import learner  # pylint: disable=import-outside-toplevel
  f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  assert learner.trims_host_memory({"w": f32(64 << 20)})  # 256 MiB: the threshold
  assert not learner.trims_host_memory({"w": f32((64 << 20) - 1), "b": f32(0)})
  assert learner.trims_host_memory({"a": f32(32 << 20), "b": [f32(16 << 20), f32(16 << 20)]})
  calls = []
  monkeypatch.setattr(learner, "release_host_memory", lambda: calls.append(1) or True)
  setup = _parity_setup([])
  _two_rl_steps(setup)
  assert calls == []  # the tiny model is below the threshold
  monkeypatch.setattr(learner, "TRIM_MIN_PARAM_BYTES", 1)
  _two_rl_steps(setup)
  assert calls == [1, 1]  # once per update
