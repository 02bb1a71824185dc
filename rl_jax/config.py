"""The base config of the trainer and its validation.

A config file is a user file that starts from ``base_config()`` and changes what it needs::

    from rl_jax import config as base

    def get_config(arg=None):
      config = base.base_config()
      config.model.num_layers = 2
      return config

Each section's fields, defaults, checks and docs are declared in ``rl_jax.settings`` (the
loss knobs in ``rl_jax.losses.KNOBS``); ``base_config`` builds the tree from them.
Every field can be overridden on the command line (``--config.rollout.n=16``); fields that
may legitimately be None are typed placeholders, so an override still type-checks
(``--config.model.hf_path=/ckpt/qwen3-0.6b``, ``--config.loss.m2po_tau=0.04``).

Paper symbols next to fields: M samples per prompt (``rollout.n``), ε_low / ε_high clip range
(``loss.eps_low`` / ``loss.eps_high``), β KL coefficient (``loss.kl_beta``), τ M2PO threshold
(``loss.m2po_tau``), η learning rate (``optim.lr``), η staleness bound
(``rollout.max_staleness``, AReaL's symbol), ρ_base VCPO ESS baseline (``loss.ess_rho_base``).

``validate(config)`` checks every value range and the cross-field rules that need no data or
devices; each failure is one ``ConfigError`` line naming the key. Allowed values come from
the modules that define them (architectures from ``rl_jax.models``, mesh axes and rule sets
from ``rl_jax.sharding``, objective knobs and advantage estimators from ``rl_jax.losses``),
so an estimator registered by a user config file is accepted too.
"""

from __future__ import annotations

import importlib
import os
from typing import Any, NamedTuple

import ml_collections
from ml_collections import config_dict

from rl_jax import config_utils as cu
from rl_jax import losses
from rl_jax import settings, storage
from rl_jax.errors import ConfigError

__all__ = ["DISTILL_KNOBS", "check_objective",
           "check_wandb", "Geometry", "Schedule", "base_config", "checks", "geometry",
           "notices", "schedule", "stage_updates", "validate"]

# preset knobs set from the distill section (distill.coef), not from config.loss
DISTILL_KNOBS = ("distill_coef",)


def _loss() -> ml_collections.ConfigDict:
  """A named preset of ``rl_jax.losses`` plus every knob, each None meaning the preset's.

  The knobs and their meanings are ``rl_jax.losses.PRESET_KNOBS`` (docs/ALGORITHMS.md,
  "Presets"); e.g. ``--config.loss.preset=m2po --config.loss.m2po_tau=0.02``.
  """
  fields = {"preset": "grpo"}
  for knob, kind in losses.PRESET_KNOB_TYPES.items():
    if knob not in DISTILL_KNOBS:
      fields[knob] = config_dict.placeholder(kind)
  return ml_collections.ConfigDict(fields)


def base_config() -> ml_collections.ConfigDict:
  """The full default config tree (unlocked): loss (the objectives' knobs) and the sections
  with typed settings (``settings.SECTIONS``: rollout, train, sft, eval, distill, log, optim,
  loss_extra, reward, data, env, mesh, distributed, dry_run, model), built from their
  classes."""
  typed = {name: settings.section_config(cls) for name, cls in settings.SECTIONS.items()}
  return ml_collections.ConfigDict(dict(loss=_loss(), **typed))


def checks() -> dict[str, cu.Check | tuple[cu.Check, ...]]:
  """Value-range checks of every field the trainer reads: ``key -> check(s)``."""
  opt = cu.optional
  return {
      **{key: check for name, cls in settings.SECTIONS.items()
         for key, check in settings.section_checks(name, cls).items()},
      "loss.preset": cu.one_of(losses.PRESETS),
      # each knob's range is declared with it (losses.KNOBS), as get_objective applies it
      **{f"loss.{name}": opt(knob.check) for name, knob in losses.KNOBS.items()
         if knob.check is not None and name not in DISTILL_KNOBS},
  }


def _check_pool(config) -> None:
  """A fixed KV pool (``rollout.kv_pages``) must hold one group's whole budget: n samples x
  the pages of the response budget (max_new_tokens, or env.max_total_tokens with an
  environment; with rollout.prompt_pages also the prompt's ids after its first; the response
  cache rounds it up to a power of two >= 8)."""
  r = config.rollout
  env = config.get("env")
  if r.kv_pages is None:
    return
  budget = geometry(config).new_tokens
  name = "env.max_total_tokens" if env is not None and env.name else "max_new_tokens"
  if r.get("prompt_pages"):
    budget += config.data.max_prompt_len - 1
    name = f"data.max_prompt_len - 1 + {name}"
  R = max(8, 1 << (budget - 1).bit_length())
  need = r.n * (R // min(r.page_size, R))
  if r.kv_pages < need:
    raise ConfigError(f"rollout.kv_pages={r.kv_pages} is smaller than one group needs: "
                      f"rollout.n={r.n} samples x {R // min(r.page_size, R)} pages of "
                      f"{min(r.page_size, R)} tokens ({name}={budget})")


def validate(config: ml_collections.ConfigDict) -> None:
  """Every value check of ``checks()`` plus the cross-field rules; first failure raises.

  Raises:
    ConfigError: one line naming the key(s), e.g.
      ``config.rollout.n must be a positive int, got 0``.
  """
  missing = [name for name in base_config() if name not in config]
  if missing:
    raise ConfigError(f"the config has no section {missing[0]!r} ({len(missing)} of "
                      f"{len(base_config())} are missing): start from "
                      "rl_jax.config.base_config() or a file in configs/, and set fields on it")
  _env_source(config)
  cu.validate(config, checks())
  _check_model(config)
  _check_pool(config)
  if (config.data.overlong_buffer or 0) > config.rollout.max_new_tokens:
    raise ConfigError(f"data.overlong_buffer={config.data.overlong_buffer} exceeds "
                      f"rollout.max_new_tokens={config.rollout.max_new_tokens}")
  for name, cls in settings.SECTIONS.items():  # their own rules (train's replay: below)
    if name != "train":
      settings.from_section(cls, name, config[name])
  shares = config.rollout.partial_shares
  if config.rollout.partial and shares and config.train.batch_groups % shares:
    raise ConfigError(f"rollout.partial_shares={shares} does not divide "
                      f"train.batch_groups={config.train.batch_groups}")
  if config.env.name and shares > 1:
    raise ConfigError(f"rollout.partial_shares={shares} needs env.name unset (the "
                      f"multi-turn engine holds every group in every process)")
  if (config.data.selector or "none") != "none" and config.rollout.partial:
    raise ConfigError(f"data.selector={config.data.selector!r} needs rollout.partial=False "
                      f"(the partial-rollout engine draws its own prompts)")
  if config.optim.stochastic_rounding and config.model.param_dtype != "bfloat16":
    raise ConfigError(f"optim.stochastic_rounding=True needs model.param_dtype=bfloat16 (got "
                      f"{config.model.param_dtype}: its updates already add exactly enough)")
  _check_group_size(config)
  _check_schedule(config)
  _check_env(config)
  _check_distill(config)
  _check_sampler_weights(config)
  _check_reward(config)
  if config.model.lora.rank and "reference" in (config.train.get("offload") or ""):
    raise ConfigError("train.offload=reference: with model.lora.rank > 0 the reference is the "
                      "frozen base the policy already holds; there is no copy to offload")
  _check_async(config)
  _check_replay(config)
  settings.from_section(settings.TrainSettings, "train", config.train)  # its own rules
  check_wandb(config)
  if config.train.batch_groups % config.train.minibatches:
    raise ConfigError(f"train.batch_groups={config.train.batch_groups} is not divisible by "
                      f"train.minibatches={config.train.minibatches}")
  per_minibatch = config.train.batch_groups // config.train.minibatches
  if config.data.group_size != "adaptive" and per_minibatch % config.train.micro_batches:
    raise ConfigError(f"train.micro_batches={config.train.micro_batches} does not divide the "
                      f"{per_minibatch} groups of a minibatch (train.batch_groups / "
                      "train.minibatches); micro-batches hold whole groups")


def stage_updates(config: ml_collections.ConfigDict) -> tuple[tuple[str, int], ...]:
  """Optimizer updates of each stage, what the schedules count (``optim.warmup_steps``, the
  cosine's length): ("RL", ``train.steps`` x ``train.minibatches`` x ``train.epochs``) and
  ("supervised", ``sft.steps``, one update each; 0 when there is no supervised stage)."""
  t = config.train
  return (("RL", t.steps * t.minibatches * t.epochs), ("supervised", config.sft.steps))


def _check_schedule(config: ml_collections.ConfigDict) -> None:
  """A cosine schedule decays after its warm-up: the warm-up must end before each stage that
  runs does."""
  o = config.optim
  if o.schedule != "cosine":
    return
  for stage, updates in stage_updates(config):
    if updates and o.warmup_steps >= updates:
      raise ConfigError(f"optim.warmup_steps={o.warmup_steps} leaves nothing of the {stage} "
                        f"stage's {updates} optimizer updates for optim.schedule=cosine to "
                        "decay over (warm-up counts updates: train.minibatches x "
                        "train.epochs per RL step, one per supervised step)")


def _check_model(config: ml_collections.ConfigDict) -> None:
  """Router replay against the rollouts that keep no expert records (SPEC-RL's drafts; the
  model section's own rules are ``settings.ModelSettings``')."""
  if config.model.router_replay and config.rollout.speculative:
    raise ConfigError("model.router_replay=True needs the sampler's expert records, which "
                      "rollout.speculative rollouts do not keep")


def _env_source(config: ml_collections.ConfigDict) -> None:
  """``env.gym_id`` / ``env.verifiers`` name the task of their adapter: with ``env.name``
  unset it becomes "gymnasium" / "verifiers" (the name every multi-turn path reads); any other
  name, both set, or an adapter's name without its key is one ConfigError line."""
  e = config.get("env")
  if e is None or "gym_id" not in e:
    return
  given = [(name, key) for name, key in settings.ENV_ADAPTERS.items() if e[key]]
  if len(given) > 1:
    raise ConfigError(f"env.gym_id={e.gym_id!r} and env.verifiers={e.verifiers!r} both name a "
                      "task; set one")
  if given:
    name, key = given[0]
    if e.name == "":
      e.name = name
    elif e.name != name:
      raise ConfigError(f"env.{key}={e[key]!r} names the task, but env.name={e.name!r} names "
                        f"another; set env.name={name!r} or leave it unset")
  elif e.name in settings.ENV_ADAPTERS:
    raise ConfigError(f"env.name={e.name!r} needs env.{settings.ENV_ADAPTERS[e.name]} (e.g. "
                      + ("env.gym_id=FrozenLake-v1)" if e.name == "gymnasium" else
                         "env.verifiers=my_tasks:load)"))


def _check_env(config: ml_collections.ConfigDict) -> None:
  """Multi-turn runs: what the agentic producer supports (fixed groups; synchronous or
  asynchronous; every episode finished within its step, or held across steps with
  ``rollout.partial``; see rl_jax.train.agent_stage). The rules of the section alone are
  ``settings.EnvSettings``'."""
  if not config.env.name:
    return
  e = config.env
  c = config
  sel = c.data.selector or "none"
  for key, bad in (("rollout.speculative=True", c.rollout.speculative),
                   ("data.group_size=adaptive", c.data.group_size == "adaptive"),
                   (f"data.selector={sel}", sel != "none"),
                   ("loss.preset=dapo (dynamic sampling)", c.loss.preset == "dapo"),
                   ("data.overlong_buffer", bool(c.data.overlong_buffer))):
    if bad:
      raise ConfigError(f"env.name={e.name!r} (multi-turn) is not supported with {key}; the "
                        "agentic producer samples fixed groups")


def notices(config: ml_collections.ConfigDict) -> list[str]:
  """Settings that run but are unlikely to do what was meant: one ``note:`` line each,
  printed when a run starts (``train.loop``)."""
  out = []
  m = config.model
  if (m.lora.rank and not m.hf_path and not m.lora.get("adapter_path")
      and m.init_std <= 0.05):
    out.append(
        f"note: model.lora.rank={m.lora.rank} on a randomly initialised base with "
        f"model.init_std={m.init_std}: the frozen random LM head caps the logits the adapters "
        "can reach, so training is likely to stall; start from a checkpoint (model.hf_path), "
        "or raise model.init_std to 0.1 and optim.lr to 5e-4 as configs/quickstart.py:lora "
        "does")
  out += _unread(config)
  d = config.data
  if d.eval_path and d.path and _same_file(d.eval_path, d.path):
    out.append(f"note: data.eval_path={d.eval_path!r} is the training file data.path: "
               "evaluation scores questions the policy trains on; leave data.eval_path unset "
               "to hold out a stable 5% of the file instead")
  o = config.optim
  for stage, updates in stage_updates(config):
    if updates and o.schedule == "constant" and o.warmup_steps > updates:
      out.append(f"note: optim.warmup_steps={o.warmup_steps} is longer than the {stage} "
                 f"stage's {updates} optimizer updates: its learning rate reaches only "
                 f"{updates / o.warmup_steps:.2g} of its peak")
  return out


def _same_file(a: str, b: str) -> bool:
  """Whether two paths name one file (``~`` expanded; links followed for local paths)."""
  if storage.is_remote(a) or storage.is_remote(b):
    return a.rstrip("/") == b.rstrip("/")
  return os.path.realpath(os.path.expanduser(a)) == os.path.realpath(os.path.expanduser(b))


# loss knobs read only by a part another knob turns on: (knob, that knob, is the part on)
_PART_KNOBS = (
    ("tis_cap", "tis_level", lambda k: k["tis_level"] is not None),
    ("mis_low", "mis_level", lambda k: k["mis_level"] is not None),
    ("mis_high", "mis_level", lambda k: k["mis_level"] is not None),
    ("mis_mode", "mis_level", lambda k: k["mis_level"] is not None),
    ("icepop_alpha", "icepop_beta", lambda k: k["icepop_beta"] is not None),
    ("geo_mean_cap", "geo_mean_is", lambda k: bool(k["geo_mean_is"])),
    ("decoupled_mode", "decoupled_cap", lambda k: k["decoupled_cap"] is not None),
    ("ess_rho_base", "ess_scaling", lambda k: bool(k["ess_scaling"])),
    ("ess_rule", "ess_scaling", lambda k: bool(k["ess_scaling"])),
    ("value_clip", "value_coef", lambda k: bool(k["value_coef"])),
    ("kl_kind", "kl_beta", lambda k: bool(k["kl_beta"])),
)
# built-in estimators whose advantages compare a group's samples with each other
_GROUP_RELATIVE = ("grpo", "dr_grpo", "rloo", "mc_grpo", "reinforce_pp_baseline")


def _knobs(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The objective's knobs as the run resolves them: the preset's, then the config's."""
  given = {k: v for k, v in config.loss.items() if k != "preset" and v is not None}
  return {**losses.PRESET_KNOB_DEFAULTS, **losses.PRESETS[config.loss.preset], **given}


def _unread(config: ml_collections.ConfigDict) -> list[str]:
  """``note:`` lines for settings that are given but that nothing in this run reads, or that
  leave the policy where it is (a greedy group, a critic nothing trains)."""
  k, loss, preset = _knobs(config), config.loss, config.loss.preset
  out = [f"note: loss.{knob}={loss[knob]!r} is read only with loss.{on} on, and this run "
         f"has loss.{on}={k[on]!r}: it has no effect"
         for knob, on, part_on in _PART_KNOBS if loss[knob] is not None and not part_on(k)]
  critic = k["advantage"] == "gae" or bool(k["value_coef"])
  if k["advantage"] == "gae" and not k["value_coef"]:
    out.append("note: loss.advantage='gae' reads a critic's values, but loss.value_coef=0 "
               "never trains it: the advantages come from the critic as initialised (the ppo "
               "preset sets loss.value_coef=0.5)")
  if config.optim.value_lr is not None and not critic and k["advantage"] in losses.NO_RETURNS:
    out.append(f"note: optim.value_lr={config.optim.value_lr} is the critic's learning rate, "
               f"and loss.preset={preset} trains no critic: it has no effect")
  if (config.rollout.temperature == 0 and config.rollout.n > 1 and not config.env.name
      and k["advantage"] in _GROUP_RELATIVE):
    out.append(f"note: rollout.temperature=0 samples a group's rollout.n={config.rollout.n} "
               f"responses alike, so {k['advantage']}'s advantages, which compare them, are 0 "
               "and the policy does not move")
  r, t = config.rollout, config.train
  free_running = t.mode == "async" and t.async_lag == -1
  unused = (("distill.coef", config.distill.coef != 1.0 and not config.distill.teacher_path,
             "distill.teacher_path set"),
            ("reward.judge_verdict", config.reward.judge_verdict != "yes_no"
             and not config.reward.judge_path, "reward.judge_path set"),
            ("train.replay.fraction", t.replay.fraction != 0.25 and not t.replay.capacity,
             "train.replay.capacity set"),
            ("rollout.over_sampling", r.over_sampling != 2.0 and not r.partial,
             "rollout.partial set"),
            ("rollout.spec_lenience", r.spec_lenience != 0.0 and not r.speculative,
             "rollout.speculative set"),
            ("train.async_lag", t.async_lag != 1 and t.mode != "async", "train.mode=async"),
            ("rollout.max_staleness", r.max_staleness != 1 and not r.partial
             and not free_running, "rollout.partial, or train.mode=async with "
             "train.async_lag=-1 (a fixed lag k trains every batch k versions late)"))
  out += [f"note: {key}={cu.get_value(config, key)!r} is read only with {on}: it has no effect"
          for key, bad, on in unused if bad]
  return out + _unread_env(config.env)


# env settings that only some built-in tasks read (a task of the user's own, env.name=
# "module:factory" or verifiers, receives the whole section and may read any of them)
_TASK_FIELDS = {"digits_min": ("calculator",), "digits_max": ("calculator",),
                "guess_n": ("guess",), "step_penalty": ("guess",),
                "tool_format": ("math_tools",), "python_timeout_s": ("math_tools",),
                "max_tool_calls": ("math_tools",), "system_prompt": ("math_tools", "gymnasium"),
                "gym_codec": ("gymnasium",), "invalid_reward": ("gymnasium",)}
_TASK_FIELDS_READERS = {task for tasks in _TASK_FIELDS.values() for task in tasks}


def _unread_env(env: ml_collections.ConfigDict) -> list[str]:
  """``note:`` lines for ``env`` settings changed from their defaults that this run's task
  does not read: any of them without ``env.name`` (the single-turn trainer), the
  task-specific ones under a built-in task that is not theirs."""
  defaults = settings.EnvSettings()
  changed = [k for k in env if k not in ("name", "kwargs") and env[k] != getattr(defaults, k)]
  if not env.name:
    return [f"note: env.{k}={env[k]!r} is read only by multi-turn tasks, and env.name is "
            "unset (the single-turn trainer): it has no effect" for k in changed]
  if env.name not in _TASK_FIELDS_READERS:
    return []
  return [f"note: env.{k}={env[k]!r} is read only by env.name={' or '.join(_TASK_FIELDS[k])}, "
          f"and this run's is {env.name}: it has no effect"
          for k in changed if k in _TASK_FIELDS and env.name not in _TASK_FIELDS[k]]


def _check_sampler_weights(config: ml_collections.ConfigDict) -> None:
  """``rollout.weight_dtype``: a run whose sampler can decode quantised weights."""
  wd = config.rollout.get("weight_dtype") or ""
  if not wd:
    return
  if config.model.lora.quant:
    raise ConfigError(f"rollout.weight_dtype={wd}: the base is already stored "
                      f"{config.model.lora.quant} (model.lora.quant) and the sampler decodes it "
                      "as it is; set one of the two")
  if config.env.name:
    raise ConfigError(f"rollout.weight_dtype={wd} needs env.name unset (the multi-turn engine "
                      "decodes in the trainer's dtype)")
  if config.rollout.speculative:
    raise ConfigError(f"rollout.weight_dtype={wd} and rollout.speculative=True cannot be "
                      "combined (the drafts are verified against the trainer's weights)")


def _check_distill(config: ml_collections.ConfigDict) -> None:
  """On-policy distillation needs its teacher; the teacher's own checks (its directory,
  its vocabulary against the policy's) run when the setup is built (``train.teacher``)."""
  path = config.get("distill", {}).get("teacher_path") or ""
  if config.loss.preset == "on_policy_distill" and not path:
    raise ConfigError("loss.preset=on_policy_distill needs distill.teacher_path=HF_DIR (the "
                      "teacher whose log-probs of the sampled tokens are the advantages)")
  if "teacher" in (config.train.get("offload") or "") and not path:
    raise ConfigError("train.offload=teacher: there is no teacher to offload (set "
                      "distill.teacher_path)")


def _check_reward(config: ml_collections.ConfigDict) -> None:
  """A group function scores whole groups of one prompt: single-turn, fixed-size groups; a
  judge, single-turn rows (the rules of the section alone are ``settings.RewardSettings``';
  the judge's directory and template are read when the setup is built, ``judge_stage``)."""
  fn, judge = config.reward.group_fn, config.reward.judge_path
  if judge and config.env.name:
    raise ConfigError(f"reward.judge_path={judge} is not supported with env.name="
                      f"{config.env.name!r}: multi-turn rewards are the environments' returns")
  if fn and config.env.name:
    raise ConfigError(f"reward.group_fn={fn!r} is not supported with env.name="
                      f"{config.env.name!r}: multi-turn rewards are the environments' returns")
  if fn and config.data.group_size == "adaptive":
    raise ConfigError(f"reward.group_fn={fn!r} needs data.group_size=fixed: adaptive group "
                      "size scores a prompt's samples in separate chunks")


def _check_async(config: ml_collections.ConfigDict) -> None:
  """Asynchronous settings that cannot work whatever the devices."""
  c = config
  n = c.mesh.rollout_devices
  if n and c.train.mode != "async":
    raise ConfigError(f"mesh.rollout_devices={n} splits the devices for train.mode='async', "
                      f"but train.mode={c.train.mode!r}; set it to 0 or use train.mode=async")
  if c.train.mode == "async" and c.train.async_lag == -1 and c.rollout.max_staleness < 1:
    raise ConfigError(f"train.async_lag=-1 (free-running) needs a staleness bound "
                      f"rollout.max_staleness >= 1, got {c.rollout.max_staleness} (0 never "
                      "overlaps, -1 is unbounded)")


def _check_replay(config: ml_collections.ConfigDict) -> None:
  """Experience replay (``train.replay``) runs in the synchronous single-turn producer only
  (its own rules, k replayed groups that fit the buffer, are ``settings.TrainSettings``')."""
  c, r = config, config.train.replay
  if not r.capacity:
    return
  what = f"train.replay.capacity={r.capacity}"
  for key, bad in (("env.name", bool(c.env.name)), ("rollout.partial", c.rollout.partial),
                   ("rollout.speculative", c.rollout.speculative),
                   ("train.mode=async", c.train.mode == "async"),
                   ("data.group_size=adaptive", c.data.group_size == "adaptive"),
                   ("rollout.mask_stale", c.rollout.mask_stale)):
    if bad:
      raise ConfigError(f"{what} is not supported with {key} (replay runs in the "
                        "synchronous single-turn producer only)")
  sel = c.data.selector or "none"
  if sel != "none" or c.loss.preset == "dapo":
    raise ConfigError(f"{what} is not supported with data.selector="
                      f"{'dapo (the dapo preset)' if sel == 'none' else repr(sel)}: replayed "
                      "groups take the place of fresh prompts, not of selected ones")


# how an objective corrects tokens of older weights (named in the one-line errors below)
_CORRECTIONS = "use vcpo, m2po or decoupled_ppo, truncated IS (loss.tis_level)"


def _uncorrected(config: ml_collections.ConfigDict, needs) -> bool:
  """Whether the objective never reads the behaviour log-probs, without the opt-out."""
  return "behaviour_logp" not in needs and not config.train.allow_uncorrected


def check_objective(config: ml_collections.ConfigDict, needs) -> None:
  """Rules between the schedule and the objective's declared inputs ``needs``: a quantised
  base cannot seed a critic (``values``) and LoRA gives it no adapters; one step off
  (a lag of at most 1) is the common practice without correction; more needs an objective
  that reads the behaviour log-probs."""
  c = config
  if c.model.lora.quant and "values" in needs:
    raise ConfigError(f"model.lora.quant={c.model.lora.quant!r}: loss.preset={c.loss.preset!r} "
                      f"trains a critic of full weights, which a quantised base cannot seed; "
                      f"use a critic-free objective or model.lora.quant=''")
  if c.model.lora.rank and "values" in needs:
    raise ConfigError(f"model.lora.rank={c.model.lora.rank}: loss.preset={c.loss.preset!r} "
                      f"needs a value model, which LoRA does not support (the critic has no "
                      f"adapters); use a critic-free objective or model.lora.rank=0")
  if c.train.replay.capacity and _uncorrected(c, needs):
    raise ConfigError(
        f"train.replay.capacity={c.train.replay.capacity} trains on replayed groups of older "
        f"weights, but loss.preset={c.loss.preset!r} never reads the behaviour log-probs to "
        f"correct them; {_CORRECTIONS}, or set train.allow_uncorrected=True")
  if c.train.mode != "async":
    return
  lag = c.train.async_lag if c.train.async_lag >= 0 else c.rollout.max_staleness
  if lag > 1 and _uncorrected(c, needs):
    what = (f"train.async_lag={lag}" if c.train.async_lag >= 0 else
            f"free-running with rollout.max_staleness={lag}")
    raise ConfigError(
        f"{what} trains on tokens up to {lag} versions "
        f"old, but loss.preset={c.loss.preset!r} never reads the behaviour log-probs to "
        f"correct them; {_CORRECTIONS}, a lag of at most 1, or set "
        "train.allow_uncorrected=True")


def check_wandb(config: ml_collections.ConfigDict) -> None:
  """``log.wandb=True`` needs the wandb package importable."""
  if not config.log.get("wandb"):
    return
  try:
    importlib.import_module("wandb")
  except ImportError as e:
    raise ConfigError("config.log.wandb=True needs the wandb package (pip install wandb), "
                      f"which cannot be imported ({e}); or set --config.log.wandb=False") from None


def _check_group_size(config: ml_collections.ConfigDict) -> None:
  """Adaptive group size: the budget splits into whole chunks, one or more per prompt."""
  d, G, M = config.data, config.train.batch_groups, config.rollout.n
  if d.group_size != "adaptive":
    return
  m = d.group_chunk if d.group_chunk is not None else max(1, M // 2)  # Geometry.row_size
  if (G * M) % m:
    raise ConfigError(f"data.group_size=adaptive: the budget train.batch_groups * rollout.n = "
                      f"{G * M} is not divisible by data.group_chunk={m}")
  if m > M:
    raise ConfigError(f"data.group_chunk={m} exceeds rollout.n={M} (each prompt needs a chunk)")
  if d.group_max is not None and (d.group_max % m or d.group_max < M):
    raise ConfigError(f"data.group_max={d.group_max}: need a multiple of {m} and >= {M}")
  if ((G * M) // m) % config.train.minibatches:
    raise ConfigError(f"data.group_size=adaptive: the {(G * M) // m} chunks of a step are not "
                      f"divisible by train.minibatches={config.train.minibatches}")
  if ((G * M) // m // config.train.minibatches) % config.train.micro_batches:
    raise ConfigError(f"data.group_size=adaptive: train.micro_batches="
                      f"{config.train.micro_batches} does not divide the "
                      f"{(G * M) // m // config.train.minibatches} chunks of a minibatch")
  sel = d.selector or "none"
  if sel not in ("none", "beta") or (sel == "none" and config.loss.preset == "dapo"):
    raise ConfigError(f"data.group_size=adaptive works with data.selector none or beta, got "
                      f"{'dapo (the dapo preset)' if sel == 'none' else sel!r}")
  for key, bad in (("rollout.speculative", config.rollout.speculative),
                   ("rollout.partial", config.rollout.partial),
                   ("train.mode=async", config.train.mode == "async")):
    if bad:
      raise ConfigError(f"data.group_size=adaptive is not supported with {key}")


# ------------------------------------------------------------------ derived static shapes
class Geometry(NamedTuple):
  """A step's batch geometry, computed once from the config (``Setup.geometry``); every
  module reads the samples per prompt and the row groups from here.

  groups: G prompts per step (``train.batch_groups``). samples: M samples per prompt
  (``rollout.n``). rows: row groups of a step (G, or W chunks with adaptive group size).
  row_size: samples per row group (M, or m per chunk). max_chunks: Z, the most chunks of one
  prompt (adaptive group size; 1 otherwise). new_tokens: R (``rollout.max_new_tokens``).
  adaptive: whether rows are chunks of a per-prompt allocation (``data.group_size``).
  turns: U, the most assistant turns of a trajectory (``env.max_turns``; 1 single-turn).
  multi_turn: whether the rollouts are episodes of an environment (``env.name`` set); then
  new_tokens is R = ``env.max_total_tokens``.
  """

  groups: int
  samples: int
  rows: int
  row_size: int
  max_chunks: int
  new_tokens: int
  adaptive: bool
  turns: int = 1
  multi_turn: bool = False


def geometry(config: ml_collections.ConfigDict) -> Geometry:
  """The batch geometry of ``config`` (see ``Geometry``), or of a ``Setup`` (whose typed
  settings have the sections' fields)."""
  G, M, R = config.train.batch_groups, config.rollout.n, config.rollout.max_new_tokens
  env = getattr(config, "env", None)
  if env is not None and env.name:
    return Geometry(G, M, G, M, 1, int(env.max_total_tokens), False, int(env.max_turns), True)
  if (config.data.group_size or "fixed") != "adaptive":
    return Geometry(G, M, G, M, 1, R, False)
  m = config.data.group_chunk
  m = int(m) if m is not None else max(1, M // 2)
  W = G * M // m
  cap = config.data.group_max
  Z = W - G + 1 if cap is None else min(int(cap) // m, W - G + 1)
  return Geometry(G, M, W, m, Z, R, True)


class Schedule(NamedTuple):
  """How producer and learner are joined (``train.mode``, ``train.async_lag``), decided once.

  lag: batches the producer runs ahead of the learner (0: the synchronous trainer; -1:
  free-running). queue: Q, the scored batches the checkpointed queue holds (0 for lag 0).
  overlapped: whether the producer runs beside the learner (the asynchronous modes: separate
  proximal log-prob pass, staleness and producer / learner timing metrics).
  """

  lag: int
  queue: int
  overlapped: bool


def schedule(config: ml_collections.ConfigDict) -> Schedule:
  """The ``Schedule`` of ``config``, or of a ``Setup``."""
  if config.train.mode != "async":
    return Schedule(0, 0, False)
  lag = config.train.async_lag
  return Schedule(lag, lag if lag >= 0 else max(config.rollout.max_staleness, 1), True)
