"""What a run is made of before any training state exists: ``build_setup(config) -> Setup``.

``build_setup`` validates the config and builds every static object the trainer needs (the
tokenizer, the task and its splits, the model config, the mesh, the objective, the
optimizers). Every mistake a user can make in the config or the data fails here, in one
``ConfigError`` / ``DataError`` line, before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, NamedTuple, Sequence

import jax
import ml_collections
import optax

from rl_jax import compile_options
from rl_jax import config as config_lib
from rl_jax import losses
from rl_jax import models
from rl_jax import optim
from rl_jax import settings
from rl_jax import sharding
from rl_jax.data import group_rewards
from rl_jax.data import rewards as rewards_lib
from rl_jax.data import tasks as tasks_lib
from rl_jax.data import tokenizers as tok_lib
from rl_jax.data.base import EmptySplitError
from rl_jax.errors import ConfigError, DataError, ModelError, RLJaxError
from rl_jax.train import agent_stage, judge_stage, selection_stage, speculative_stage
from rl_jax.train.inputs import PROVIDED_INPUTS, SINGLE_TURN_INPUTS

__all__ = ["Job", "Optimizers", "Setup", "build_setup", "device_rules", "job", "split_devices",
           "teacher_config",
           "PROVIDED_INPUTS"]



class Optimizers(NamedTuple):
  """The optax transforms of the three stages."""

  rl: optax.GradientTransformationExtraArgs  # policy update, then the objective's transform
  sft: optax.GradientTransformation          # supervised warm start
  value: optax.GradientTransformation        # PPO critic


@dataclasses.dataclass(frozen=True)
class Setup:
  """Static objects derived from the config (no training state).

  ``train_examples`` / ``eval_examples`` are random-access sequences of ``Example``; the
  trainer indexes them with the seeded sampler and never copies a split. ``prompt_len`` is
  P, the prompt bucket (longest tokenized prompt + 1). ``mesh`` spans every device of the
  job (but the rollout devices of ``train.mode="async"``); ``sampler_mesh`` is the mesh the
  sampler runs on: the same with one process, this process's own devices with several (each
  process samples on its own devices; the asynchronous trainer's on its share of the rollout
  devices, ``split_devices``), its ``tensor`` axis ``mesh.sampler_tensor`` when set;
  ``sampler_rules`` the rule set it lays its weights out by.
  With ``env.name`` set, ``task`` is the environment task (``rl_jax.envs.spec.EnvSpec``)
  and the splits are ``agent_stage.EnvExample``s (the rendered first prompt of each).
  The config's sections arrive as their typed settings (``rollout``, ``train``, ``sft``,
  ``eval``, ``distill``, ``log``, ``optim``, ``loss_extra``, ``reward``, ``data``, ``env``,
  ``dry_run``, ``model``: ``settings.SETUP_SECTIONS``); the setup holds no config. ``geometry`` (the
  step's groups, samples per group and chunks), ``schedule`` (how the producer and learner
  are joined) and ``selection`` (how prompts are picked and rewards shaped) are derived from
  them once, and again by ``dataclasses.replace``; every module reads them from here.
  """

  tokenizer: Any
  task: Any
  train_examples: Sequence[tasks_lib.Example]
  eval_examples: Sequence[tasks_lib.Example]
  model_cfg: models.ModelConfig
  mesh: jax.sharding.Mesh
  sampler_mesh: jax.sharding.Mesh
  rules: str
  sampler_rules: str  # the sampler's rule set: rules, or "fsdp_tp" with mesh.sampler_tensor
  objective: losses.Objective
  optimizers: Optimizers
  prompt_len: int
  eos_id: int
  rollout: settings.RolloutSettings
  train: settings.TrainSettings
  sft: settings.SftSettings
  eval: settings.EvalSettings
  distill: settings.DistillSettings
  log: settings.LogSettings
  optim: settings.OptimSettings
  loss_extra: settings.LossExtraSettings
  reward: settings.RewardSettings
  data: settings.DataSettings
  env: settings.EnvSettings
  dry_run: settings.DryRunSettings
  model: settings.ModelSettings  # ModelConfig (model_cfg) is built from these
  chat: Any = None  # multi-turn runs (env.name): the task's chat format (agent_stage)
  teacher_cfg: Any = None  # distill.teacher_path: the teacher's ModelConfig (train.teacher)
  group_fn: Any = None  # reward.group_fn: the group reward function (data.group_rewards)
  judge: Any = None  # reward.judge_path: the judge model, weights read on first use (judge_stage)
  # the names of the reward components (a verifier or group function returning {name: r}),
  # in the order of the objective's reward_components [G,M,C]; () for plain rewards
  reward_names: tuple = ()
  geometry: config_lib.Geometry = dataclasses.field(init=False)
  schedule: config_lib.Schedule = dataclasses.field(init=False)
  # how the run picks its prompts and shapes their rewards (data.selector, the preset)
  selection: selection_stage.Selection = dataclasses.field(init=False)

  @property
  def sampler_cfg(self) -> models.ModelConfig:
    """The ModelConfig the rollouts decode with: ``model_cfg``, or with
    ``rollout.weight_dtype`` ("int8", "fp8") its dense projections quantised, a float32
    scale per ``head_dim`` entries of each contraction axis (``models.quant``); the trainer
    keeps ``model_cfg``."""
    wd = self.rollout.weight_dtype
    if not wd:
      return self.model_cfg
    return self.model_cfg.replace(quant=wd, quant_block=self.model_cfg.head_dim)

  @property
  def shared_sampler(self) -> bool:
    """Whether the sampler decodes from the training weights where they lie (the training
    mesh and rules); else it keeps a copy laid out for its own mesh or rules
    (``mesh.sampler_tensor``, several processes, rollout devices)."""
    return self.sampler_mesh is self.mesh and self.sampler_rules == self.rules

  def __post_init__(self):  # the settings have the config sections' fields
    object.__setattr__(self, "geometry", config_lib.geometry(self))
    object.__setattr__(self, "schedule", config_lib.schedule(self))
    object.__setattr__(self, "selection", selection_stage.make_selection(
        self.data, self.objective.name, self.rollout, self.train.seed))


def mesh_shape(shape_cfg, n_devices: int) -> dict[str, int]:
  """``mesh.shape`` with its one ``-1`` axis resolved to the remaining devices."""
  shape = {k: int(v) for k, v in dict(shape_cfg).items()}
  free = [k for k, v in shape.items() if v == -1]
  if len(free) > 1:
    raise ConfigError(f"mesh.shape: at most one axis may be -1, got {free}")
  known = math.prod(v for v in shape.values() if v != -1)
  if free:
    if n_devices % known:
      raise ConfigError(f"mesh.shape {shape} does not divide {n_devices} devices")
    shape[free[0]] = n_devices // known
  if math.prod(shape.values()) != n_devices:
    raise ConfigError(f"mesh.shape {shape} needs {math.prod(shape.values())} devices, "
                      f"have {n_devices}")
  return shape


def make_objective(config) -> losses.Objective:
  """The configured preset with every knob that is set; rejects what the trainer cannot feed."""
  knobs = {k: v for k, v in config.loss.to_dict().items() if k != "preset" and v is not None}
  # C of ...-token-sum-norm: the response budget, also when the learner's batch is cut
  # shorter (train.trim_floor), so the loss does not depend on the step's longest response
  knobs.setdefault("agg_norm", float(config_lib.geometry(config).new_tokens))
  if config.distill.teacher_path:  # the teacher's per-token term (alone or beside the task's)
    knobs["distill_coef"] = float(config.distill.coef)
  try:
    obj = losses.get_objective(config.loss.preset, **knobs)
  except ValueError as e:
    raise ConfigError(f"loss: {e}") from None
  accepted = PROVIDED_INPUTS if config.env.name else SINGLE_TURN_INPUTS  # per-turn: agentic
  missing = sorted(obj.needs - accepted)
  if missing:
    raise ConfigError(f"loss: the objective ({config.loss.preset}) needs {missing}, which the "
                      "trainer does not compute; use it through rl_jax.losses directly"
                      + ("" if config.env.name else " (per-turn inputs need env.name)"))
  if "teacher_logp" in obj.needs and not config.distill.teacher_path:
    raise ConfigError(f"loss: the objective ({config.loss.preset}) reads a teacher's "
                      "log-probs (on-policy distillation); set distill.teacher_path=HF_DIR")
  if obj.batch_global and config.train.micro_batches > 1:
    raise ConfigError(f"train.micro_batches={config.train.micro_batches}: the objective "
                      f"({config.loss.preset}) takes a statistic over the whole minibatch (the "
                      "M2PO mask), which micro-batches would change; use train.micro_batches=1")
  if obj.single_pass and config.train.epochs > 1:
    raise ConfigError(f"train.epochs={config.train.epochs}: the objective "
                      f"({config.loss.preset}) has a policy term that is the policy gradient "
                      "only on the data's own policy (plain REINFORCE, -A*logp) with no "
                      "importance ratio to correct the passes after the first, which run on "
                      "updated weights; use loss.policy=ppo_clip or reinforce_ratio, or "
                      "train.epochs=1")
  if (obj.estimator == "mc_grpo" and config.data.group_size != "adaptive"
      and config.rollout.n < 2):
    raise ConfigError(f"rollout.n={config.rollout.n}: MC-GRPO's advantages (loss.preset="
                      f"{config.loss.preset}) centre each group on the median of its other "
                      "samples; it needs rollout.n >= 2")
  return obj


def _env_task(e: settings.EnvSettings, data: settings.DataSettings, sft_steps: int,
              tokenizer, tokenizer_path: str | None):
  """(task, train split, eval split, chat format) of a multi-turn run (``env.name``)."""
  fmt = agent_stage.task_chat_format(e, tokenizer, tokenizer_path)
  spec = agent_stage.env_task(e, data, sft_steps, fmt)
  train = agent_stage.env_examples(spec, spec.train, fmt)
  evals = agent_stage.env_examples(spec, spec.eval[:data.eval_size], fmt)
  if e.agent:  # the episodes are the agent's sessions; the prompts stay the task's
    spec = agent_stage.agent_task(e, spec, fmt, tokenizer)
  return spec, train, evals, fmt


def _task(sections: dict, hf_path: str | None):
  """(tokenizer, task, train split, eval split, P, chat format or None) of the typed
  ``sections`` and the checkpoint ``hf_path``, with data errors as one line."""
  d, e = sections["data"], sections["env"]
  fmt = None
  try:
    tokenizer = tok_lib.load_tokenizer(d.tokenizer or hf_path or "char")
    if e.name:
      task, train, evals, fmt = _env_task(e, d, sections["sft"].steps, tokenizer,
                                          d.tokenizer or hf_path)
    elif d.task == "file":
      task = tasks_lib.get_task("file", path=d.path or "", format=d.format,
                                eval_path=d.eval_path, template=d.template, seed=d.seed)
    else:
      _file_settings_unread(d)
      task = tasks_lib.get_task(d.task, difficulty=d.difficulty, seed=d.seed)
    if fmt is None:
      train = task.split("train")
      evals = _eval_split(task, d, evaluates=bool(sections["train"].eval_every))
    longest = _longest_prompt(tokenizer, train, evals)
  except (ValueError, FileNotFoundError, OSError) as e:
    if isinstance(e, RLJaxError):
      raise
    raise DataError(f"data: {' '.join(str(e).split())}") from None
  if not len(train):  # pylint: disable=g-explicit-length-test
    raise ConfigError(f"data: the train split of {d.task!r} is empty")
  if sections["train"].eval_every and not evals:
    raise ConfigError(f"data: the eval split of {d.task!r} is empty")
  if longest[0] > d.max_prompt_len:
    n, split, i = longest
    raise ConfigError(f"data: {split} prompt {i} has {n} tokens > data.max_prompt_len="
                      f"{d.max_prompt_len} (the longest prompt allowed)")
  return tokenizer, task, train, evals, longest[0] + 1, fmt


def _file_settings_unread(d: settings.DataSettings) -> None:
  """One line for a setting only a file task reads, given to a built-in task."""
  defaults = {f.name: f.default for f in dataclasses.fields(settings.DataSettings)}
  given = [f"data.{k}={getattr(d, k)!r}" for k in ("path", "eval_path", "format", "template")
           if getattr(d, k) != defaults[k]]
  if given:
    raise ConfigError(f"{given[0]} is read only by data.task='file', not by data.task="
                      f"{d.task!r}: set --config.data.task=file to train on a file")


def _eval_split(task, d: settings.DataSettings, *, evaluates: bool) -> list:
  """The first ``data.eval_size`` held-out examples; a file whose prompts all hash into the
  train split has none: one line when the run evaluates, else no eval split."""
  try:
    evals = task.split("eval")
  except EmptySplitError:
    if evaluates:
      raise ConfigError(f"data: {d.path} leaves no held-out prompts (a hash of each prompt "
                        "puts about 1 in 20 in the eval split): set data.eval_path to a "
                        "held-out file, or train.eval_every=0") from None
    return []
  return [evals[i] for i in range(min(d.eval_size, len(evals)))]


def _longest_prompt(tokenizer, train, evals) -> tuple[int, str, int]:
  """(tokens, split, index) of the longest tokenized prompt of the two splits ((0, "train",
  0) when there is none)."""
  out = (0, "train", 0)
  for split, examples in (("train", train), ("eval", evals)):
    for i, e in enumerate(examples):
      try:
        n = len(tok_lib.encode_prompt(tokenizer, e.prompt))
      except ValueError as err:
        char = (" (the character tokenizer: model.hf_path and data.tokenizer are unset)"
                if isinstance(tokenizer, tok_lib.CharTokenizer) else "")
        raise ValueError(f"{split} prompt {i}: {err}{char}") from None
      if n > out[0]:
        out = (n, split, i)
  return out


def _rewards(config, task, train) -> tuple[Any, tuple[str, ...]]:
  """(group function or None, reward component names) of a single-turn run.

  The names are those of the reward on the first training example with its own reference
  as the completion: the verifier's value, or with ``reward.group_fn`` the function's on a
  group of M copies of it (which also checks its output once, before anything compiles).
  A verifier that fails on it gives no names; a group function that fails is one line.
  DAPO overlong shaping adds its penalty as the component ``overlong`` when there are names.
  A judge (``reward.judge_path``) gives plain numbers: no names.
  """
  if config.env.name or config.reward.get("judge_path"):
    return None, ()
  name, first = config.reward.get("group_fn", ""), train[0]
  timeout = config.data.reward_timeout_s
  if name:
    fn, who = group_rewards.resolve(name), f"reward.group_fn={name!r}"
    M = config.rollout.n
    try:
      values = rewards_lib.call_isolated(lambda: fn([first.answer] * M, first), timeout)
    except RLJaxError:
      raise
    except (Exception, rewards_lib.VerifierTimeout) as e:  # noqa: BLE001
      what = "timed out" if isinstance(e, rewards_lib.VerifierTimeout) else (
          f"raised {type(e).__name__}: {' '.join(str(e).split())}")
      raise ConfigError(f"{who}: called on {M} copies of the first training example's "
                        f"reference answer, it {what}") from None
    values = group_rewards.check_group_values(values, M, who)
  else:
    values, _ = rewards_lib.verify_rows(task.verify, [first.answer], [first.answer], timeout)
    who = "the task's verifier"
  names = rewards_lib.component_names(values[0])
  rewards_lib.stack_components(values, names, who)  # every row the same names
  if names and selection_stage.overlong_buffer(config.data.overlong_buffer, config.loss.preset,
                                               config.rollout.max_new_tokens):
    if "overlong" in names:
      raise ConfigError(f"{who} returns a component named 'overlong', the name of DAPO's "
                        "overlong penalty (data.overlong_buffer); rename it")
    names += ("overlong",)
  return (fn if name else None), tuple(names)


def _family_fields(m) -> dict:
  """ModelConfig fields of the Qwen3-MoE and Gemma 3 families from ``config.model``
  (random init; ``rl_jax.config`` has checked them against the architecture)."""
  L = m.num_layers
  if m.architecture == "qwen3_moe":
    return dict(num_experts=m.num_experts, num_experts_per_tok=m.num_experts_per_tok,
                moe_intermediate_size=m.moe_intermediate_size or m.intermediate_size,
                norm_topk_prob=m.norm_topk_prob,
                sparse_layers=tuple((i + 1) % m.moe_every == 0 for i in range(L)))
  if m.architecture == "gemma3":
    out = dict(query_pre_attn_scalar=float(m.head_dim), rope_local_theta=10000.0)
    if m.attention == "sliding":
      out.update(layer_types=tuple("full_attention" if (i + 1) % m.global_every == 0 else
                                   "sliding_attention" for i in range(L)),
                 sliding_window=m.sliding_window)
    return out
  return {}


def _fused_mlp(m) -> bool | str:
  """``model.fused_mlp`` for the ModelConfig: None (the default) is "auto"."""
  return "auto" if m.fused_mlp is None else bool(m.fused_mlp)


def _weights_dtype(m) -> str:
  """Storage dtype of the model's weights apart from adapters (``ModelConfig.param_dtype``):
  ``model.param_dtype`` for a model trained whole; with ``model.lora.rank`` the frozen base's,
  ``model.lora.base_dtype`` or else the compute dtype ``model.dtype``."""
  if m.lora.rank:
    return m.lora.base_dtype or m.dtype
  return m.param_dtype


def _model_config(m: settings.ModelSettings, tokenizer) -> models.ModelConfig:
  """The policy's ModelConfig: the model settings ``m`` (or the checkpoint's config.json
  with ``m.hf_path``) with the run's dtypes, LoRA and quantisation."""
  if m.hf_path:
    cfg = models.read_hf_config(m.hf_path, dtype=m.dtype, param_dtype=_weights_dtype(m),
                                remat=m.remat, fused_mlp=_fused_mlp(m),
                                scan_layers=m.scan_layers)
  else:
    cfg = models.ModelConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, architecture=m.architecture,
        rope_theta=m.rope_theta, max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings, dtype=m.dtype, param_dtype=_weights_dtype(m),
        remat=m.remat, fused_mlp=_fused_mlp(m), scan_layers=m.scan_layers,
        qkv_bias=m.architecture == "qwen2",
        qk_norm=m.architecture in ("qwen3", "qwen3_moe", "gemma3"),
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id, **_family_fields(m))
  cfg = cfg.replace(prefix_attention=m.prefix_attention)
  m.check_moe_fields(cfg.architecture)  # the checkpoint's architecture
  if m.moe_capacity_factor:
    cfg = cfg.replace(moe_capacity_factor=float(m.moe_capacity_factor))
  if m.lora.rank:
    try:
      cfg = cfg.replace(lora_rank=m.lora.rank, lora_alpha=float(m.lora.alpha),
                        lora_targets=models.lora.parse_targets(m.lora.targets),
                        lora_dtype=m.param_dtype)
    except ModelError as e:
      raise ConfigError(f"model.lora: {e}") from None
    if m.lora.adapter_path:  # its header against the run's LoRA fields and base
      try:
        models.check_hf_adapter(cfg, m.lora.adapter_path, m.hf_path)
      except ModelError as e:
        raise ConfigError(f"model.lora.adapter_path={m.lora.adapter_path}: {e}") from None
  if m.lora.quant:
    problem = models.config.quant_block_problem(cfg, m.lora.quant_block)
    if problem:
      raise ConfigError(f"model.lora.quant_block={m.lora.quant_block} {problem} (the "
                        f"contraction axes of the quantised projections)")
    cfg = cfg.replace(quant=m.lora.quant, quant_block=m.lora.quant_block)
  if cfg.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only "
                      f"{cfg.vocab_size}")
  return cfg


def _teacher_where(config) -> str:
  return f"distill.teacher_path={config.distill.teacher_path}"


def teacher_config(config, policy_cfg: models.ModelConfig, tokenizer) -> models.ModelConfig | None:
  """On-policy distillation's teacher (``rl_jax.train.teacher``): its ModelConfig from
  ``distill.teacher_path`` (None without one), compute and storage dtype ``model.dtype``, the
  policy's remat, MLP and attention settings.

  Raises:
    ConfigError: one line: the directory or its ``config.json`` is missing or unreadable,
      the vocabulary sizes differ, or both sides have tokenizers that differ.
  """
  path = config.distill.teacher_path
  if not path:
    return None
  m = config.model
  try:
    cfg = models.read_hf_config(path, dtype=m.dtype, param_dtype=m.dtype, remat=m.remat,
                                fused_mlp=_fused_mlp(m), scan_layers=m.scan_layers)
  except (ModelError, ValueError, KeyError) as e:
    raise ConfigError(f"{_teacher_where(config)}: {e}") from None
  cfg = cfg.replace(prefix_attention=policy_cfg.prefix_attention)
  if cfg.vocab_size != policy_cfg.vocab_size:
    raise ConfigError(f"{_teacher_where(config)}: the teacher has a vocabulary of "
                      f"{cfg.vocab_size} tokens, the policy {policy_cfg.vocab_size}; on-policy "
                      "distillation needs the same vocabulary (the teacher scores the policy's "
                      "token ids)")
  _check_teacher_vocabulary(config, tokenizer)
  return cfg


def _has_tokenizer_files(path: str) -> bool:
  return any(os.path.isfile(os.path.join(path, f))
             for f in ("tokenizer.json", tok_lib.CHAR_TOKENIZER_FILE))


def _check_teacher_vocabulary(config, tokenizer) -> None:
  """Where the teacher's directory has tokenizer files, its token -> id map must be the
  policy tokenizer's (one ConfigError line naming a differing token otherwise)."""
  path = config.distill.teacher_path
  if not _has_tokenizer_files(path):
    return
  try:
    theirs = tok_lib.load_tokenizer(path).vocab()
  except (OSError, ValueError) as e:
    raise ConfigError(f"{_teacher_where(config)}: cannot read its tokenizer: {e}") from None
  ours = tokenizer.vocab()
  if theirs == ours:
    return
  differ = sorted(set(ours.items()) ^ set(theirs.items()), key=lambda kv: kv[1])
  token, _ = differ[0]
  moved = len(set(ours.items()) - set(theirs.items()))
  raise ConfigError(f"{_teacher_where(config)}: the teacher's tokenizer differs from the "
                    f"policy's ({moved} of {len(ours)} tokens map to other ids, e.g. {token!r}: "
                    f"{ours.get(token)} here, {theirs.get(token)} in the teacher); on-policy distillation needs the "
                    "same vocabulary")


class Job(NamedTuple):
  """The devices a run is built for: every device of the job, the process count P, this
  process's index and its own devices. ``job()``: this job's (``jax.devices()``); ``job(d)``:
  the devices ``d``, e.g. the abstract devices of a TPU topology (``rl_jax.train.topology``),
  planned as their first process sees them."""

  devices: list
  processes: int
  index: int
  local: list


def job(devices: Sequence[Any] | None = None) -> Job:
  """The ``Job`` of ``devices`` (default: this job's)."""
  if devices is None:
    return Job(list(jax.devices()), jax.process_count(), jax.process_index(),
               list(jax.local_devices()))
  devices = list(devices)
  index = devices[0].process_index
  return Job(devices, len({d.process_index for d in devices}), index,
             [d for d in devices if d.process_index == index])


def device_rules(config, devices: Sequence[Any] | None = None) -> None:
  """The config rules that depend on the devices and processes of this job (every static
  rule is in ``rl_jax.config``), one ``ConfigError`` line each; ``devices``: those of
  another job (``job``)."""
  _device_rules(config, job(devices))


def _device_rules(config, j: Job) -> None:
  n, c, P = config.mesh.rollout_devices, config, j.processes
  if n >= len(j.devices):
    raise ConfigError(f"mesh.rollout_devices={n} leaves no device for the training mesh "
                      f"({len(j.devices)} devices exist)")
  if P > 1 and c.train.mode == "async" and c.train.async_lag < 0:
    raise ConfigError("train.async_lag=-1 (free-running) runs in one process; with "
                      f"{P} processes set a fixed lag train.async_lag=k >= 1")
  if P > 1 and n and (n % P or n // P >= len(j.local)):
    raise ConfigError(f"mesh.rollout_devices={n} does not split evenly over {P} processes "
                      f"(each gives rollout_devices/{P} of its {len(j.local)} "
                      f"devices to the sampler and keeps at least one for training)")
  shares = c.rollout.partial_shares
  if P > 1 and c.rollout.partial and shares % P:
    raise ConfigError(f"rollout.partial_shares={shares} does not split evenly over {P} "
                      f"processes (each runs and holds rollout.partial_shares/{P} engines)")
  devices = len(j.devices) - n
  n_dev = c.mesh.num_devices or devices
  if n_dev > devices:
    raise ConfigError(f"mesh.num_devices={n_dev} but only {devices} devices exist"
                      + (f" besides mesh.rollout_devices={n}" if n else ""))
  if P > 1 and n_dev % P:
    raise ConfigError(f"mesh.num_devices={n_dev} does not split evenly over {P} processes")
  t = c.mesh.sampler_tensor
  per = n // P if n else (len(j.local) if P > 1 else n_dev)
  if t and per % t:
    where = " in each process" if P > 1 else ""
    raise ConfigError(f"mesh.sampler_tensor={t} does not divide the sampler's {per} "
                      f"devices{where}")


def split_devices(devices: Sequence[Any], rollout: int,
                  train: int | None = None) -> tuple[list, list]:
  """(rollout devices, training devices) of the job, in ``devices``' order.

  Each of the P processes gives its first ``rollout / P`` devices to the sampler and its
  next ``train / P`` (default: all the rest) to the training mesh, so both sets span every
  process alike; with one process that is ``devices[:rollout]`` and the ``train`` after them.

  Args:
    devices: every device of the job (``jax.devices()``), each with its ``process_index``.
    rollout: rollout devices in all (a multiple of P; ``device_rules`` checks).
    train: training devices in all (a multiple of P), or None for every other device.
  """
  by_process: dict[int, list] = {}
  for d in devices:
    by_process.setdefault(d.process_index, []).append(d)
  P = len(by_process)
  k = rollout // P
  roll, trn = [], []
  for local in by_process.values():
    per = len(local) - k if train is None else train // P
    roll += local[:k]
    trn += local[k:k + per]
  return roll, trn


def _mesh(config, j: Job) -> jax.sharding.Mesh:
  """The training mesh over the devices after the rollout devices (all of them in sync mode)."""
  _, devices = split_devices(j.devices, config.mesh.rollout_devices,
                             config.mesh.num_devices or None)
  return sharding.make_mesh(mesh_shape(config.mesh.shape, len(devices)), devices)


def _sampler_mesh(config, mesh: jax.sharding.Mesh, j: Job) -> jax.sharding.Mesh:
  """The training mesh with one process (or the asynchronous trainer's own rollout devices,
  groups over ``fsdp``: with several processes this process's share of them); with several
  processes and no rollout devices, this process's devices with the training mesh's
  ``sequence`` and ``tensor`` sizes (KV cache along sequence, heads along tensor) when they
  fit, groups over ``fsdp``. ``mesh.sampler_tensor`` = t > 0 sets the sampler's ``tensor``
  size to t instead (and with one process gives the sampler a mesh of its own over the
  training devices, ``sampler_rules``)."""
  n, t = config.mesh.rollout_devices, config.mesh.sampler_tensor
  if n:
    roll, _ = split_devices(j.devices, n)
    local = [d for d in roll if d.process_index == j.index]
    return sharding.make_mesh({"fsdp": len(local) // max(t, 1), "tensor": max(t, 1)}, local)
  if j.processes == 1 and not _own_sampler_layout(config, mesh):
    return mesh
  local = j.local if j.processes > 1 else list(mesh.devices.flat)
  inner = {a: mesh.shape[a] for a in ("sequence", "tensor")}
  if t:
    inner["tensor"] = t  # divides len(local): _device_rules
  if len(local) % (inner["sequence"] * inner["tensor"]):
    inner = {"sequence": 1, "tensor": t or 1}
  fsdp = len(local) // (inner["sequence"] * inner["tensor"])
  return sharding.make_mesh({"fsdp": fsdp, **inner}, local)


def sampler_rules(config) -> str:
  """The rule set the sampler lays out its weights and KV cache by: ``mesh.rules``, or
  with ``mesh.sampler_tensor`` > 1 ``"fsdp_tp"`` (heads, MLP and vocab over the sampler's
  ``tensor`` axis), whatever the training rules."""
  return "fsdp_tp" if config.mesh.sampler_tensor > 1 else config.mesh.rules


def _own_sampler_layout(config, mesh: jax.sharding.Mesh) -> bool:
  """Whether ``mesh.sampler_tensor`` lays the sampler out otherwise than the training mesh
  (another ``tensor`` size or other rules)."""
  t = config.mesh.sampler_tensor
  return bool(t) and (t != mesh.shape["tensor"] or sampler_rules(config) != config.mesh.rules)


def _optimizers(config, objective: losses.Objective) -> Optimizers:
  """The stages' optimizers; their schedules count updates (``config_lib.stage_updates``)."""
  o, updates = config.optim, dict(config_lib.stage_updates(config))
  rl = optax.chain(optim.make_optimizer(o, o.lr, updates["RL"]), objective.update_transform)
  return Optimizers(rl=rl, sft=optim.make_optimizer(o, config.sft.lr, updates["supervised"]),
                    value=optim.make_optimizer(o, o.value_lr or o.lr, updates["RL"]))


def build_setup(config: ml_collections.ConfigDict,
                devices: Sequence[Any] | None = None) -> Setup:
  """Validate ``config`` and build everything static; fails in one line before compiling.
  ``devices``: build the meshes over these (every device of a job, ``job``; e.g. an abstract
  TPU topology's, which programs are compiled for but never run on) instead of this job's."""
  config_lib.validate(config)  # every static rule
  compile_options.use_fast_cpu_compile(config.train.cpu_fast_compile)  # for this run's programs
  compile_options.use_cpu_xla_reductions(config.train.cpu_xla_reductions)
  compile_options.use_cpu_temp_blocks(config.train.cpu_temp_block_mib)
  objective = make_objective(config)
  config_lib.check_objective(config, objective.needs)
  j = job(devices)
  _device_rules(config, j)
  sections = {name: settings.from_section(settings.SECTIONS[name], name, config[name])
              for name in settings.SETUP_SECTIONS}
  tokenizer, task, train, evals, prompt_len, fmt = _task(sections, config.model.hf_path)
  model_cfg = _model_config(sections["model"], tokenizer)
  speculative_stage.check_draft_bytes(config.rollout.speculative, config_lib.geometry(config),
                                      len(train), model_cfg.vocab_size)
  mesh = _mesh(config, j)
  R, what = ((config.env.max_total_tokens, "env.max_total_tokens") if fmt is not None else
             (config.rollout.max_new_tokens, "rollout.max_new_tokens"))
  if prompt_len + R > model_cfg.max_position_embeddings:
    raise ConfigError(f"data: prompts of {prompt_len} tokens + {what}={R} exceed the model's "
                      f"{model_cfg.max_position_embeddings} positions")
  teacher_cfg = teacher_config(config, model_cfg, tokenizer)
  wd = config.rollout.get("weight_dtype") or ""
  problem = wd and models.config.quant_block_problem(model_cfg, model_cfg.head_dim)
  if problem:
    raise ConfigError(f"rollout.weight_dtype={wd}: the scale blocks of head_dim="
                      f"{model_cfg.head_dim} entries {problem}")
  group_fn, reward_names = _rewards(config, task, train)
  judge = judge_stage.make_judge(sections["reward"], config.model.dtype)  # weights: first use
  eos = config.rollout.eos_id
  if eos is not None and not 0 <= eos < model_cfg.vocab_size:
    raise ConfigError(f"config.rollout.eos_id={eos} is outside the model's vocabulary "
                      f"[0, {model_cfg.vocab_size})")
  if eos is None and not 0 <= tokenizer.eos_id < model_cfg.vocab_size:
    raise ConfigError(f"the end-of-sequence id {tokenizer.eos_id} of the tokenizer of "
                      f"{config.data.tokenizer or config.model.hf_path} is outside the model's "
                      f"vocabulary [0, {model_cfg.vocab_size}): fix its eos_token "
                      "(tokenizer_config.json), or set rollout.eos_id")
  return Setup(tokenizer=tokenizer, task=task, train_examples=train,
               eval_examples=evals, model_cfg=model_cfg, mesh=mesh,
               sampler_mesh=_sampler_mesh(config, mesh, j), rules=config.mesh.rules,
               sampler_rules=sampler_rules(config),
               objective=objective, optimizers=_optimizers(config, objective),
               prompt_len=prompt_len, eos_id=tokenizer.eos_id if eos is None else eos,
               chat=fmt, teacher_cfg=teacher_cfg, group_fn=group_fn, judge=judge,
               reward_names=reward_names, **sections)
