"""The base config (rl_jax.config): every objective knob is a typed, command-line settable
field that reaches the objective; allowed values come from the modules that define them."""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import config as base
from rl_jax import config_utils, losses
from rl_jax.errors import ConfigError
from rl_jax.train import context

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
SAMPLE = {str: None, float: "0.5", bool: "true", tuple: "(1.0, 2.0)"}
STR_SAMPLES = {"dual_clip": "3.0", "advantage": "rloo", "policy": "reinforce", "kl_kind": "k2", "tis_level": "token",
               "decoupled_mode": "clamp", "agg": "seq-mean-token-sum", "ess_rule": "linear",
               "mis_level": "sequence", "mis_mode": "mask", "mis_high": "1.5",
               "icepop_beta": "5.0"}


LOSS_KNOBS = [k for k in losses.PRESET_KNOBS if k not in base.DISTILL_KNOBS]
COMPANIONS = {"value_coef": ["loss.advantage=gae"]}  # a value loss fits GAE's returns


def test_every_preset_knob_is_a_field():
  """Each knob is a loss.<knob> field, but those set from the distill section."""
  assert set(base.base_config().loss) == {"preset"} | set(LOSS_KNOBS)
  assert set(base.DISTILL_KNOBS) <= set(losses.PRESET_KNOBS)


@pytest.mark.parametrize("knob", LOSS_KNOBS)
def test_every_preset_knob_is_settable_from_the_command_line(knob):
  kind = losses.PRESET_KNOB_TYPES[knob]
  raw = STR_SAMPLES.get(knob, SAMPLE[kind])
  config = config_utils.load_config(QUICKSTART,
                                    [f"loss.{knob}={raw}", *COMPANIONS.get(knob, ())])
  value = config.loss[knob]
  assert isinstance(value, kind), (knob, value)
  base.validate(config)
  context.make_objective(config)  # the knob is accepted by the objective builder


# a value each knob's declared range rejects: the config and get_objective say the same
BAD_KNOB_VALUES = {"eps_low": -0.1, "kl_beta": -1.0, "gamma": 1.5, "mis_low": 1.0,
                   "mis_high": 0.5, "icepop_beta": 1.0, "icepop_alpha": 1.0, "tis_cap": 0.0,
                   "agg": "mean", "kl_kind": "k9", "value_clip": 0.0, "ess_rho_base": -2.0,
                   "adv_eps": 0.0, "ace_alpha": -1.0}


@pytest.mark.parametrize("knob", sorted(BAD_KNOB_VALUES))
def test_a_knobs_range_is_one_rule_for_the_config_and_get_objective(knob):
  """Each knob's range is declared with it (losses.KNOBS): the config's loss section and
  get_objective reject the same value with the same requirement."""
  bad = BAD_KNOB_VALUES[knob]
  requirement = losses.KNOBS[knob].problem(bad)
  assert requirement
  config = base.base_config()
  config.loss[knob] = bad
  with pytest.raises(ConfigError, match=f"config.loss.{knob} {re.escape(requirement)}, got"):
    base.validate(config)
  with pytest.raises(ValueError, match=f"option {knob}={re.escape(repr(bad))} "
                                       f"{re.escape(requirement)}"):
    losses.get_objective("grpo", **{knob: bad})


def test_knob_ranges_take_numpy_scalars():
  obj = losses.get_objective("grpo", eps_low=np.float32(0.1), gamma=np.float64(0.5))
  assert obj is not None
  with pytest.raises(ValueError, match="option eps_low=.* must be a number >= 0"):
    losses.get_objective("grpo", eps_low=np.float32(-0.1))


def test_every_preset_sets_its_knobs_within_their_ranges():
  for name, knobs in losses.PRESETS.items():
    for knob, value in {**losses.PRESET_KNOB_DEFAULTS, **knobs}.items():
      assert losses.KNOBS[knob].problem(value) is None, (name, knob, value)
  checked = {k for k in base.checks() if k.startswith("loss.")}
  assert checked == {"loss.preset"} | {f"loss.{k}" for k, knob in losses.KNOBS.items()
                                       if knob.check is not None and k in LOSS_KNOBS}


def test_knobs_reach_the_objective():
  """m2po_tau set on the command line changes the M2PO mask and so the loss."""
  rng = np.random.default_rng(0)
  B, T = 8, 6
  logp = jnp.asarray(rng.normal(-1.0, 0.3, (B, T)), jnp.float32)
  batch = losses.LossBatch(mask=jnp.ones((B, T), bool), advantages=jnp.asarray(rng.normal(size=B)),
                       old_logp=logp, behaviour_logp=logp + jnp.asarray(
                           rng.normal(0, 0.5, (B, T)), jnp.float32))

  def loss(tau):
    config = config_utils.load_config(QUICKSTART, ["loss.preset=m2po", f"loss.m2po_tau={tau}"])
    obj = context.make_objective(config)
    s, d, mets = obj.loss(logp, obj.prepare(batch))
    return float(s / d), float(mets["m2po_masked_frac"])

  (l_small, f_small), (l_big, f_big) = loss(0.001), loss(10.0)
  assert f_small > 0.5 and f_big == 0.0
  assert l_small != l_big


def test_allowed_values_follow_the_registry():
  """An estimator registered after the checks were built is accepted by validation."""
  checks = base.checks()
  config = config_utils.load_config(QUICKSTART, ["loss.advantage=my_estimator_for_test"],
                                    lock=False)
  with pytest.raises(ConfigError, match="loss.advantage"):
    config_utils.validate(config, checks)
  losses.register_advantage(
      "my_estimator_for_test",
      lambda knobs: losses.AdvantageEstimator(lambda x: losses.Advantages(x.rewards), "mine"),
      overwrite=True)
  config_utils.validate(config, checks)


@pytest.mark.parametrize("override,word", [
    ("loss.kl_kind=k9", "loss.kl_kind"), ("loss.agg=mean", "loss.agg"),
    ("optim.schedule=linear", "optim.schedule"), ("mesh.rules=tp", "mesh.rules"),
    ("model.remat=some", "model.remat"), ("loss_extra.grad_norm_method=exact",
                                          "grad_norm_method"),
])
def test_bad_choice_names_the_key(override, word):
  config = config_utils.load_config(QUICKSTART, [override])
  with pytest.raises(ConfigError, match=word) as e:
    base.validate(config)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,word", [
    (["data.selector=random"], "data.selector"), (["data.max_tries=0"], "data.max_tries"),
    (["data.select_pool=0.5"], "data.select_pool"), (["data.beta_mode=ucb"], "data.beta_mode"),
    (["data.beta_decay=1.5"], "data.beta_decay"),
    (["data.overlong_buffer=6"], "data.overlong_buffer"),
    (["data.selector=greso", "rollout.partial=True"], "data.selector"),
    (["rollout.speculative=True", "rollout.partial=True"], "rollout.speculative"),
    (["rollout.speculative=True", "rollout.temperature=0.0"], "rollout.speculative"),
    (["rollout.spec_lenience=-1.0"], "rollout.spec_lenience"),
    (["rollout.partial=True", "train.batch_groups=8", "rollout.partial_shares=3"],
     "rollout.partial_shares"),
])
def test_bad_selection_settings_fail_in_one_line(overrides, word):
  config = config_utils.load_config(QUICKSTART, overrides)
  with pytest.raises(ConfigError, match=word) as e:
    base.validate(config)
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides,note", [
    (["loss.tis_cap=3.0"], "note: loss.tis_cap=3.0 is read only with loss.tis_level on, and "
     "this run has loss.tis_level=None: it has no effect"),
    (["loss.mis_high=1.5"], "loss.mis_high=1.5 is read only with loss.mis_level on"),
    (["loss.icepop_alpha=0.5"], "loss.icepop_alpha=0.5 is read only with loss.icepop_beta on"),
    (["loss.kl_kind=k1", "loss.kl_beta=0.0"], "loss.kl_kind='k1' is read only with "
     "loss.kl_beta on, and this run has loss.kl_beta=0.0"),
    (["loss.value_clip=0.3"], "loss.value_clip=0.3 is read only with loss.value_coef on"),
    (["loss.preset=ppo", "loss.value_coef=0.0"], "loss.value_coef=0 never trains it"),
    (["optim.value_lr=0.001"], "optim.value_lr=0.001 is the critic's learning rate, and "
     "loss.preset=grpo trains no critic"),
    (["rollout.temperature=0"], "rollout.temperature=0 samples a group's rollout.n=8 responses "
     "alike, so grpo's advantages"),
    (["distill.coef=5.0"], "distill.coef=5.0 is read only with distill.teacher_path set"),
    (["reward.judge_verdict=score"], "reward.judge_verdict='score' is read only with "
     "reward.judge_path set"),
    (["train.replay.fraction=0.5"], "train.replay.fraction=0.5 is read only with "
     "train.replay.capacity set"),
    (["rollout.over_sampling=3.0"], "rollout.over_sampling=3.0 is read only with "
     "rollout.partial set"),
    (["rollout.spec_lenience=0.5"], "rollout.spec_lenience=0.5 is read only with "
     "rollout.speculative set"),
    (["train.async_lag=3"], "train.async_lag=3 is read only with train.mode=async"),
    (["train.mode=async", "train.async_lag=2", "rollout.max_staleness=0",
      "loss.preset=vcpo"], "rollout.max_staleness=0 is read only with rollout.partial, or "
     "train.mode=async with train.async_lag=-1 (a fixed lag k trains every batch k versions "
     "late)"),
    (["env.max_turns=5"], "env.max_turns=5 is read only by multi-turn tasks, and env.name "
     "is unset (the single-turn trainer): it has no effect"),
    (["env.name=calculator", "env.guess_n=7"], "env.guess_n=7 is read only by env.name=guess, "
     "and this run's is calculator: it has no effect"),
])
def test_a_setting_nothing_reads_gets_a_note(overrides, note):
  """A value given for a part the run does not have is not silently dropped: one ``note:``
  line names it and what would read it; the same part turned on reads it, without a note."""
  notes = base.notices(config_utils.load_config(QUICKSTART, overrides))
  assert len(notes) == 1 and note in notes[0], notes


def test_a_held_out_file_that_is_the_training_file_gets_a_note(tmp_path):
  """The same file through another spelling (``./``, a link) is still the same file."""
  train = tmp_path / "train.jsonl"
  train.write_text("")
  (tmp_path / "link.jsonl").symlink_to(train)
  for eval_path in (str(train), f"{tmp_path}/./train.jsonl", str(tmp_path / "link.jsonl")):
    config = config_utils.load_config(QUICKSTART, ["data.task=file", f"data.path={train}",
                                                   f"data.eval_path={eval_path}"])
    (note,) = base.notices(config)
    assert "is the training file data.path: evaluation scores questions" in note, note
  (tmp_path / "test.jsonl").write_text("")
  assert base.notices(config_utils.load_config(
      QUICKSTART, ["data.task=file", f"data.path={train}",
                   f"data.eval_path={tmp_path / 'test.jsonl'}"])) == []


@pytest.mark.parametrize("overrides", [
    ["loss.tis_cap=3.0", "loss.tis_level=token"], ["loss.preset=vcpo", "loss.tis_cap=3.0"],
    ["loss.preset=ppo", "optim.value_lr=0.001"], ["rollout.temperature=0", "rollout.n=1"],
    ["loss.kl_kind=k1", "loss.kl_beta=0.01"], ["rollout.temperature=0", "loss.preset=ppo"],
    ["rollout.over_sampling=3.0", "rollout.partial=True"],
    ["env.name=guess", "env.guess_n=7", "env.max_turns=5"],
    ["env.name=calculator", "env.digits_max=4", "env.kwargs.anything=1"],
    ["train.mode=async", "train.async_lag=-1", "rollout.max_staleness=2",
     "loss.preset=vcpo"],
])
def test_a_setting_its_part_reads_gets_no_note(overrides):
  assert base.notices(config_utils.load_config(QUICKSTART, overrides)) == []


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(os.path.join(ROOT, "configs"))
                                        if f.endswith(".py")))
def test_the_shipped_configs_get_no_note(name):
  assert base.notices(config_utils.load_config(os.path.join(ROOT, "configs", name), [])) == []
