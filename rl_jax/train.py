"""The canonical trainer: supervised warm start, then RL (GRPO family / PPO) on verifiable tasks.

    python -m rl_jax.train --config=configs/quickstart.py --workdir=DIR [--config.x.y=v ...]

One step (synchronous mode)::

    prompts (seeded sampler) -> rollout.generate (N samples per prompt, behaviour log-probs)
      -> rewards (isolated verifiers) -> advantages (objective)
      -> old / reference log-probs (packed prompt-once layout)
      -> `train.minibatches` optax updates of the objective's loss

Writes DIR/metrics.jsonl, DIR/tensorboard/, DIR/checkpoints/, DIR/curves.png and DIR/hf/
(the final policy in HF format). Rerunning the same command resumes from the newest
checkpoint, bit-exactly: every random draw is a function of (seed, step) and the data
position is part of the checkpoint. SIGTERM saves a checkpoint and exits cleanly.

Shapes: G prompts per step, M samples per prompt (config ``rollout.n``), P prompt bucket,
R = rollout.max_new_tokens, B = G·M rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import signal
import sys
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax

from rl_jax import checkpoint as ckpt_lib
from rl_jax import config_utils
from rl_jax import losses
from rl_jax import metrics as metrics_lib
from rl_jax import models
from rl_jax import rollout
from rl_jax import sharding
from rl_jax.data import rewards as rewards_lib
from rl_jax.data import selection
from rl_jax.data import tasks as tasks_lib
from rl_jax.data import tokenizers as tok_lib
from rl_jax.errors import ConfigError, DataError, RLJaxError


class TrainState(NamedTuple):
  """Everything a resumed run needs (a pytree; checkpointed whole).

  step: int32 [] completed steps (supervised + RL). params / opt_state: policy and its RL
  optimizer state. sft_opt_state: optimizer state of the supervised stage. ref_params: the
  frozen reference policy (the policy when RL starts; ``{}`` if the objective has no KL).
  value_params / value_opt_state: the PPO critic and its optimizer state (``{}`` otherwise).
  data: int32 [2] (epoch, position) of the prompt sampler.
  rollout_buffer: with ``rollout.partial``, the rollout engine's held groups (partial and
  extra complete ones) as fixed-shape arrays (``RolloutEngine.export_held``); ``{}`` otherwise.
  """

  step: jax.Array
  params: Any
  opt_state: Any
  sft_opt_state: Any
  ref_params: Any
  value_params: Any
  value_opt_state: Any
  data: jax.Array
  rollout_buffer: Any


class Rollouts(NamedTuple):
  """One step's groups, device arrays. prompt_tokens [G,P]; prompt_lengths [G];
  tokens/mask/behaviour_logp [G,M,R]; advantages [G,M] (sequence) or [G,M,R] (GAE);
  old/ref logp [G,M,R]; returns/old_values [G,M,R] for PPO (None otherwise)."""

  prompt_tokens: jax.Array
  prompt_lengths: jax.Array
  tokens: jax.Array
  mask: jax.Array
  behaviour_logp: jax.Array
  advantages: jax.Array
  old_logp: jax.Array
  ref_logp: jax.Array | None = None
  returns: jax.Array | None = None
  old_values: jax.Array | None = None


# ------------------------------------------------------------------------------ set-up
@dataclasses.dataclass
class Setup:
  """Static objects derived from the config (no training state)."""

  config: ml_collections.ConfigDict
  tokenizer: Any
  task: Any
  train_examples: list
  eval_examples: list
  model_cfg: models.ModelConfig
  mesh: jax.sharding.Mesh
  rules: str
  objective: losses.Objective
  rl_tx: optax.GradientTransformation
  sft_tx: optax.GradientTransformation
  value_tx: optax.GradientTransformation
  prompt_len: int


def _mesh_shape(shape_cfg, n_devices: int) -> dict[str, int]:
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


def _objective(config) -> losses.Objective:
  knobs = {k: v for k, v in config.loss.to_dict().items() if k != "preset" and v is not None}
  unknown = sorted(set(knobs) - set(losses.PRESET_KNOBS))
  if unknown:
    raise ConfigError(f"loss: unknown knobs {unknown}; known: {sorted(losses.PRESET_KNOBS)}")
  try:
    obj = losses.get_objective(config.loss.preset, **knobs)
  except ValueError as e:
    raise ConfigError(f"loss: {e}") from None
  if obj.needs_entropy:
    raise ConfigError("loss.entropy_coef: the trainer does not compute per-token entropy; "
                      "leave it unset (an entropy bonus is available in rl_jax.losses)")
  if obj.estimator == "mc_grpo":
    raise ConfigError("loss: the mc_grpo advantage needs N+1 samples per prompt with the "
                      "pivot dropped, which the trainer does not do; use it through "
                      "rl_jax.losses directly")
  return obj


def _optimizer(o, lr: float, steps: int) -> optax.GradientTransformation:
  if o.schedule == "cosine":
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(o.warmup_steps, 1), max(steps, 2))
  else:
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, max(o.warmup_steps, 1)), optax.constant_schedule(lr)],
        [o.warmup_steps]) if o.warmup_steps else lr
  parts = [optax.clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  parts.append(optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay))
  return optax.chain(*parts)


def build_setup(config) -> Setup:
  """Validate the config and build everything static; fails in one line before compiling."""
  from configs import common  # pylint: disable=import-outside-toplevel
  config_utils.validate(config, common.checks())
  if config.train.batch_groups % config.train.minibatches:
    raise ConfigError(f"train.batch_groups={config.train.batch_groups} is not divisible by "
                      f"train.minibatches={config.train.minibatches}")
  d = config.data
  try:
    tokenizer = tok_lib.load_tokenizer(d.tokenizer or config.model.hf_path or "char")
    if d.task == "file":
      task = tasks_lib.get_task("file", path=d.path or "", format=d.format,
                                eval_path=d.eval_path, template=d.template, seed=d.seed)
    else:
      task = tasks_lib.get_task(d.task, difficulty=d.difficulty, seed=d.seed)
    train_examples = list(task.split("train"))
    eval_examples = list(task.split("eval"))[:d.eval_size]
    prompt_len = max((len(tokenizer.encode(e.prompt)) for e in train_examples + eval_examples),
                     default=0) + 1
  except (ValueError, FileNotFoundError, OSError) as e:
    if isinstance(e, RLJaxError):
      raise
    raise DataError(f"data: {' '.join(str(e).split())}") from None
  if not train_examples:
    raise ConfigError(f"data: the train split of {config.data.task!r} is empty")
  if config.train.eval_every and not eval_examples:
    raise ConfigError(f"data: the eval split of {config.data.task!r} is empty")
  if prompt_len > config.data.max_prompt_len:
    raise ConfigError(f"data: a prompt has {prompt_len} tokens > data.max_prompt_len="
                      f"{config.data.max_prompt_len}")
  m = config.model
  if m.hf_path:
    model_cfg = models.read_hf_config(m.hf_path, dtype=m.dtype, param_dtype=m.param_dtype,
                                      remat=m.remat)
  else:
    model_cfg = models.ModelConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size, num_layers=m.num_layers, num_heads=m.num_heads,
        num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, architecture=m.architecture,
        rope_theta=m.rope_theta, max_position_embeddings=m.max_position_embeddings,
        tie_word_embeddings=m.tie_word_embeddings, dtype=m.dtype, param_dtype=m.param_dtype,
        remat=m.remat, qkv_bias=m.architecture == "qwen2", qk_norm=m.architecture == "qwen3",
        bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id)
  if model_cfg.vocab_size < tokenizer.vocab_size:
    raise ConfigError(f"tokenizer has {tokenizer.vocab_size} tokens but the model only "
                      f"{model_cfg.vocab_size}")
  n_dev = config.mesh.num_devices or jax.device_count()
  if n_dev > jax.device_count():
    raise ConfigError(f"mesh.num_devices={n_dev} but only {jax.device_count()} devices exist")
  mesh = sharding.make_mesh(_mesh_shape(config.mesh.shape, n_dev), jax.devices()[:n_dev])
  if prompt_len + config.rollout.max_new_tokens > model_cfg.max_position_embeddings:
    raise ConfigError(f"data: prompts of {prompt_len} tokens + rollout.max_new_tokens="
                      f"{config.rollout.max_new_tokens} exceed the model's "
                      f"{model_cfg.max_position_embeddings} positions")
  objective = _objective(config)
  rl_tx = optax.chain(_optimizer(config.optim, config.optim.lr, config.train.steps),
                      objective.update_transform)
  sft_tx = _optimizer(config.optim, config.sft.lr, config.sft.steps)
  value_tx = _optimizer(config.optim, config.optim.value_lr or config.optim.lr,
                        config.train.steps)
  return Setup(config, tokenizer, task, train_examples, eval_examples, model_cfg,
               mesh, config.mesh.rules, objective, rl_tx, sft_tx, value_tx, prompt_len)


# ------------------------------------------------------------------------------ state
def init_state(s: Setup) -> TrainState:
  """Fresh state: params from ``model.hf_path`` or a seeded random init, placed sharded."""
  shardings = models.param_shardings(s.model_cfg, s.mesh, s.rules)
  hf_path = s.config.model.hf_path
  if hf_path:
    _, params = models.load_hf(hf_path, dtype=jnp.dtype(s.model_cfg.param_dtype),
                               shardings=shardings)
  else:
    params = models.init_sharded(s.model_cfg, jax.random.key(s.config.train.seed), s.mesh,
                                 s.rules, std=s.config.model.init_std)
  state = _state_from_params(s, params)
  state = state._replace(rollout_buffer=jax.tree.map(jnp.asarray, _empty_buffer(s)))
  return _replicate_rest(state, s.mesh)


def _state_from_params(s: Setup, params) -> TrainState:
  """The rest of a fresh state (optimizer states, reference, critic) from the policy params."""
  # a copy: the supervised step donates params, which must not free the reference's buffers
  ref = jax.tree.map(jnp.copy, params) if s.objective.needs_ref else {}
  value, value_opt = {}, {}
  if s.objective.needs_values:  # critic warm-started from (a copy of) the policy trunk
    value = models.init_value_params(s.model_cfg, jax.random.key(0),
                                     policy_params=jax.tree.map(jnp.copy, params))
    value_opt = jax.jit(s.value_tx.init)(value)
  return TrainState(step=jnp.zeros((), jnp.int32), params=params,
                    opt_state=jax.jit(s.rl_tx.init)(params),
                    sft_opt_state=jax.jit(s.sft_tx.init)(params), ref_params=ref,
                    value_params=value, value_opt_state=value_opt,
                    data=jnp.zeros((2,), jnp.int32), rollout_buffer={})


def _held_capacity(s: Setup) -> int:
  """Most groups the partial-rollout engine can hold between steps."""
  return math.ceil(s.config.rollout.over_sampling * s.config.train.batch_groups)


def make_engine(s: Setup) -> rollout.RolloutEngine | None:
  """The APRIL rollout engine of ``rollout.partial`` runs (None otherwise)."""
  r = s.config.rollout
  if not r.partial:
    return None
  return rollout.RolloutEngine(
      s.model_cfg, n=r.n, max_slots=_held_capacity(s), max_new_tokens=r.max_new_tokens,
      max_prompt_len=s.prompt_len, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
      eos_id=_eos_id(s), over_sampling=r.over_sampling,
      max_staleness=None if r.max_staleness < 0 else r.max_staleness,
      seed=_seed_int(s.config.train.seed, 0, 5), mesh=s.mesh, rules=s.rules,
      context=s.model_cfg.max_position_embeddings)


def _empty_buffer(s: Setup) -> dict:
  """``TrainState.rollout_buffer`` of a fresh run: host arrays with nothing held."""
  engine = make_engine(s)
  return {} if engine is None else engine.export_held(_held_capacity(s))


def abstract_state(s: Setup) -> TrainState:
  """Shapes, dtypes and shardings of ``init_state(s)``, computing and loading nothing.

  The restore target on resume: no HF weights are read and no second copy of the state is
  allocated just to be overwritten by the checkpoint.
  """
  cfg = s.model_cfg
  dtype = jnp.dtype(cfg.param_dtype)
  params = jax.tree.map(lambda shape, sh: jax.ShapeDtypeStruct(shape, dtype, sharding=sh),
                        models.param_shapes(cfg), models.param_shardings(cfg, s.mesh, s.rules),
                        is_leaf=lambda x: isinstance(x, tuple))
  build = jax.jit(functools.partial(_state_from_params, s))
  shapes = jax.eval_shape(build, params)
  out = build.lower(params).compile().output_shardings
  replicated = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec())

  def spec(x, sh):
    on_mesh = isinstance(sh, jax.sharding.NamedSharding) and sh.mesh == s.mesh
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh if on_mesh else replicated)

  state = jax.tree.map(spec, shapes, out)
  buffer = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                       sharding=replicated), _empty_buffer(s))
  return state._replace(rollout_buffer=buffer)


def _replicate_rest(tree, mesh):
  """Every array not already laid out on ``mesh`` (optimizer counts, step, data position)
  becomes replicated on it, so a restored state has the same placement as a fresh one."""
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def place(x):
    on_mesh = isinstance(x.sharding, jax.sharding.NamedSharding) and x.sharding.mesh == mesh
    return x if on_mesh else jax.device_put(x, replicated)

  return jax.tree.map(place, tree)


def _seed_int(seed: int, step: int, stream: int) -> int:
  return int(np.random.default_rng([seed, stream, step]).integers(0, 2**31 - 1))


# ------------------------------------------------------------------------------ jitted steps
def _finite_update(tx, params, opt_state, grads, loss, **extra):
  """One optax update, skipped (params and state unchanged) if loss or grads are not finite."""
  finite = jnp.isfinite(loss) & jnp.all(jnp.asarray(
      [jnp.all(jnp.isfinite(g)) for g in jax.tree.leaves(grads)]))
  updates, new_opt = tx.update(grads, opt_state, params, **extra)
  new_params = optax.apply_updates(params, updates)
  pick = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
  return pick(new_params, params), pick(new_opt, opt_state), finite


def make_sft_step(s: Setup):
  """Jitted supervised step on prompt+answer sequences (loss on answer tokens only)."""
  cfg = s.model_cfg

  def step(params, opt_state, tokens, attn_mask, loss_mask):
    def loss_fn(p):
      lp = models.sequence_logprobs(cfg, p, tokens, attention_mask=attn_mask)
      return -jnp.sum(lp * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1.0)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    params, opt_state, finite = _finite_update(s.sft_tx, params, opt_state, grads, loss)
    return params, opt_state, {"sft_loss": loss, "grad_norm": optax.global_norm(grads),
                               "update_skipped": 1 - finite.astype(jnp.int32)}

  return jax.jit(step, donate_argnums=(0, 1))


def make_logprob_fn(s: Setup):
  """Jitted per-token log-probs [G,M,R] of grouped responses (packed layout by default)."""
  temp = s.config.rollout.temperature or 1.0
  shared = s.config.train.shared_prefix
  return jax.jit(lambda p, pt, pl, rt, rm: models.response_logprobs(
      s.model_cfg, p, pt, pl, rt, rm, shared_prefix=shared, temperature=temp))


def make_value_fn(s: Setup):
  """Jitted critic values [G,M,R] of grouped responses (PPO)."""
  shared = s.config.train.shared_prefix
  return jax.jit(lambda v, pt, pl, rt, rm: models.response_values(
      s.model_cfg, v, pt, pl, rt, rm, shared_prefix=shared))


def make_rl_update(s: Setup):
  """Jitted RL update on one minibatch of groups (policy, and the critic for PPO).

  ``update(params, opt_state, value_params, value_opt_state, rollouts)`` returns the four
  updated and a metrics dict. A non-finite loss or policy gradient skips the policy update, a
  non-finite critic gradient the critic update; either counts as a skipped step.
  """
  cfg, obj = s.model_cfg, s.objective
  temp = s.config.rollout.temperature or 1.0
  shared = s.config.train.shared_prefix

  def update(params, opt_state, value_params, value_opt_state, r: Rollouts):
    G, M, R = r.tokens.shape
    rows = lambda a: None if a is None else a.reshape(G * M, *a.shape[2:])
    batch = losses.Batch(mask=rows(r.mask), advantages=rows(r.advantages),
                         old_logp=rows(r.old_logp), behaviour_logp=rows(r.behaviour_logp),
                         ref_logp=rows(r.ref_logp), returns=rows(r.returns),
                         old_values=rows(r.old_values))
    batch = obj.prepare(batch)

    def loss_fn(p, v):
      lp = models.response_logprobs(cfg, p, r.prompt_tokens, r.prompt_lengths, r.tokens, r.mask,
                                    shared_prefix=shared, temperature=temp)
      values = None
      if obj.needs_values:
        values = rows(models.response_values(cfg, v, r.prompt_tokens, r.prompt_lengths,
                                             r.tokens, r.mask, shared_prefix=shared))
      loss_sum, denom, mets = obj.loss(rows(lp), batch, values=values)
      return losses.finalize(loss_sum, denom), mets

    (loss, mets), (grads, vgrads) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        params, value_params)
    # VCPO: rho = ESS/B of this optimizer step's minibatch scales the final update.
    ess = (losses.ess_ratio_from_sums(mets["vcpo/sum_w"], mets["vcpo/sum_w2"],
                                      mets["vcpo/num_seqs"]) if "vcpo/sum_w" in mets else 1.0)
    extra = {"ess_ratio": ess}
    params, opt_state, finite = _finite_update(s.rl_tx, params, opt_state, grads, loss, **extra)
    if obj.needs_values:
      value_params, value_opt_state, vfinite = _finite_update(
          s.value_tx, value_params, value_opt_state, vgrads, loss)
      finite &= vfinite
    mets = dict(mets, loss=loss, grad_norm=optax.global_norm(grads), ess_ratio=ess,
                update_skipped=1 - finite.astype(jnp.int32))
    return params, opt_state, value_params, value_opt_state, mets

  return jax.jit(update, donate_argnums=(0, 1, 2, 3))


def make_grad_norm_fn(s: Setup):
  """Jitted per-trajectory squared gradient norms [G,M] of summed response log-probs (VCPO)."""
  cfg, temp = s.model_cfg, s.config.rollout.temperature or 1.0
  method = s.config.loss_extra.grad_norm_method
  chunk = s.config.loss_extra.grad_norm_chunk

  def row_logp(p, x):
    pt, pl, rt, rm = x
    lp = models.response_logprobs(cfg, p, pt, pl, rt[:, None], rm[:, None], shared_prefix=False,
                                  temperature=temp)
    return lp.sum(axis=(1, 2))

  def fn(params, pt, pl, rt, rm, key):
    G, M, R = rt.shape
    x = (jnp.repeat(pt, M, axis=0), jnp.repeat(pl, M, axis=0), rt.reshape(G * M, R),
         rm.reshape(G * M, R))
    sq = losses.per_row_grad_sq_norms(row_logp, params, x, method=method, key=key,
                                      chunk_size=chunk if method == "map" else None)
    return sq.reshape(G, M)

  return jax.jit(fn)


# ------------------------------------------------------------------------------ host side
def _encode_prompts(s: Setup, examples) -> list[list[int]]:
  return [s.tokenizer.encode(e.prompt) for e in examples]


def _pad_prompts(prompts: list[list[int]], P: int, pad: int) -> tuple[np.ndarray, np.ndarray]:
  out = np.full((len(prompts), P), pad, np.int32)
  for i, p in enumerate(prompts):
    out[i, :len(p)] = p
  return out, np.asarray([len(p) for p in prompts], np.int32)


def _decode(s: Setup, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
  return [s.tokenizer.decode([int(t) for t, m in zip(row, mrow) if m]) for row, mrow in
          zip(tokens, mask)]


def _sft_batch(s: Setup, examples) -> tuple[np.ndarray, ...]:
  """[prompt][answer][eos] rows, right-padded; loss mask on answer and eos targets."""
  tok = s.tokenizer
  rows, prompt_lens = [], []
  for e in examples:
    p = tok.encode(e.prompt)
    rows.append(p + tok.encode(e.answer) + [_eos_id(s)])
    prompt_lens.append(len(p))
  T = s.prompt_len + s.config.rollout.max_new_tokens
  tokens = np.full((len(rows), T), tok.pad_id, np.int32)
  attn = np.zeros((len(rows), T), bool)
  loss_mask = np.zeros((len(rows), T), np.float32)
  for i, (row, pl) in enumerate(zip(rows, prompt_lens)):
    row = row[:T]
    tokens[i, :len(row)] = row
    attn[i, :len(row)] = True
    loss_mask[i, pl:len(row)] = 1.0  # targets at positions >= prompt length
  return tokens, attn, loss_mask


def _next_examples(s: Setup, data: np.ndarray, n: int):
  state = selection.SamplerState(int(s.config.data.seed), int(data[0]), int(data[1]))
  idx, state = selection.sampler_next(state, len(s.train_examples), n)
  return [s.train_examples[i] for i in idx], np.asarray([state.epoch, state.position], np.int32)


def _eos_id(s: Setup) -> int:
  """``rollout.eos_id`` if set, else the tokenizer's EOS."""
  eos = s.config.rollout.eos_id
  return s.tokenizer.eos_id if eos is None else eos


def _generate(s: Setup, params, prompts, **kw):
  """``rollout.generate`` on the trainer's mesh with the task's EOS and length budget."""
  return rollout.generate(s.model_cfg, params, prompts,
                          max_new_tokens=s.config.rollout.max_new_tokens,
                          eos_id=_eos_id(s), mesh=s.mesh, rules=s.rules, **kw)


def evaluate(s: Setup, params, step: int) -> dict[str, float]:
  """Greedy accuracy (and pass@k if ``eval.pass_k`` > 0) on the held-out split."""
  c = s.config
  examples = s.eval_examples
  prompts = _encode_prompts(s, examples)
  out = _generate(s, params, prompts, n=1, temperature=0.0, seed=0)
  completions = _decode(s, np.asarray(out.tokens), np.asarray(out.mask))
  rewards, _ = rewards_lib.compute_rewards(s.task.verify, completions, [e.answer for e in examples],
                                           timeout_s=c.data.reward_timeout_s)
  result = {"eval_accuracy": float(np.mean(rewards >= 1.0))}
  k = c.eval.pass_k
  if k > 0:
    out = _generate(s, params, prompts, n=k, temperature=c.rollout.temperature or 1.0,
                    seed=_seed_int(c.train.seed, step, 7))
    completions = _decode(s, np.asarray(out.tokens), np.asarray(out.mask))
    refs = [e.answer for e in examples for _ in range(k)]
    r, _ = rewards_lib.compute_rewards(s.task.verify, completions, refs,
                                       timeout_s=c.data.reward_timeout_s)
    result[f"eval_pass@{k}"] = float(np.mean((r.reshape(len(examples), k) >= 1.0).any(axis=1)))
  return result


def _last_token_rewards(rewards: jax.Array, mask: jax.Array) -> jax.Array:
  """Sequence rewards [G,M] placed on the last valid token: [G,M,R] (GAE's token rewards)."""
  last = jnp.maximum(jnp.sum(mask, axis=-1) - 1, 0)
  onehot = jnp.arange(mask.shape[-1]) == last[..., None]
  return jnp.where(onehot & mask, rewards[..., None], 0.0)


def rl_rollouts(s: Setup, state: TrainState, fns: dict) -> tuple[Rollouts, dict, np.ndarray]:
  """Sample groups, score them, compute advantages and old/ref log-probs."""
  c = s.config
  G, M, R = c.train.batch_groups, c.rollout.n, c.rollout.max_new_tokens
  step = int(state.step)
  t0 = time.perf_counter()
  engine = fns.get("engine")
  if engine is None:
    examples, data = _next_examples(s, np.asarray(state.data), G)
    prompts = _encode_prompts(s, examples)
    out = _generate(s, state.params, prompts, n=M, temperature=c.rollout.temperature,
                    top_p=c.rollout.top_p, top_k=c.rollout.top_k,
                    seed=_seed_int(c.train.seed, step, 1))
    updates = {"data": data}
  else:
    out, updates = _partial_rollouts(s, state, engine)
    examples = [s.train_examples[i] for i in out.group_meta]
    prompts = out.prompts
  tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
  rollout_s = time.perf_counter() - t0
  loss_mask = mask
  if engine is not None and c.rollout.mask_stale:  # only tokens of the current policy
    loss_mask = mask & (np.asarray(out.versions) >= step)
  completions = _decode(s, tokens, mask)
  refs = [e.answer for e in examples for _ in range(M)]
  rewards, stats = rewards_lib.compute_rewards(s.task.verify, completions, refs,
                                               timeout_s=c.data.reward_timeout_s)
  rewards = rewards.reshape(G, M)
  pt, pl = _pad_prompts(prompts, s.prompt_len, s.tokenizer.pad_id)
  pt, pl = jnp.asarray(pt), jnp.asarray(pl)
  rt = jnp.asarray(tokens.reshape(G, M, R))
  rm = jnp.asarray(loss_mask.reshape(G, M, R))
  obj = s.objective
  old = fns["logprob"](state.params, pt, pl, rt, rm)
  ref = fns["logprob"](state.ref_params, pt, pl, rt, rm) if obj.needs_ref else None
  mu = jnp.asarray(np.asarray(out.logprobs).reshape(G, M, R))
  returns = old_values = None
  if obj.needs_values:  # PPO: GAE over token rewards with the critic's values
    old_values = fns["values"](state.value_params, pt, pl, rt, rm)
    full = jnp.asarray(mask.reshape(G, M, R))  # the last generated token, stale or not
    adv, returns = obj.advantages(_last_token_rewards(jnp.asarray(rewards), full).reshape(G * M, R),
                                  values=old_values.reshape(G * M, R), mask=rm.reshape(G * M, R))
    adv, returns = adv.reshape(G, M, R), returns.reshape(G, M, R)
  elif obj.needs_grad_norms:  # VCPO: off-policy optimal baseline
    log_w = losses.sequence_log_weights(old.reshape(G * M, R), mu.reshape(G * M, R),
                                        rm.reshape(G * M, R)).reshape(G, M)
    sq = fns["grad_norms"](state.params, pt, pl, rt, rm,
                           jax.random.key(_seed_int(c.train.seed, step, 3)))
    adv = obj.advantages(jnp.asarray(rewards), log_w=log_w, grad_sq_norms=sq)
  elif obj.estimator == "reinforce_pp":  # token-level returns, KL to the reference folded in
    kl = (losses.kl_penalty(old, ref, "k1").reshape(G * M, R) if obj.needs_ref else None)
    adv = obj.advantages(jnp.asarray(rewards).reshape(G * M), mask=rm.reshape(G * M, R),
                         kl=kl).reshape(G, M, R)
  elif obj.estimator == "reinforce_pp_baseline":  # whitened over valid tokens
    adv = obj.advantages(jnp.asarray(rewards), lengths=jnp.sum(rm, axis=-1))
  else:
    adv = obj.advantages(jnp.asarray(rewards))
  n_tok = int(mask.sum())
  info = {
      "reward_mean": float(rewards.mean()),
      "reward_std": float(rewards.std()),
      "response_length": n_tok / (G * M),
      "rollout_tokens_per_s": n_tok / max(rollout_s, 1e-9),
      "reward_exceptions": stats["exceptions"],
      "reward_timeouts": stats["timeouts"],
      "zero_variance_groups": float(np.mean(rewards.std(axis=1) == 0)),
  }
  if engine is not None:
    info.update({k: float(out.stats[k]) for k in (
        "off_policy_token_fraction", "max_token_lag", "aborted_groups", "restarted_samples",
        "buffer_size")})
  return Rollouts(pt, pl, rt, rm, mu, adv, old, ref, returns, old_values), info, updates


def _partial_rollouts(s: Setup, state: TrainState, engine: rollout.RolloutEngine):
  """K complete groups from the APRIL engine, whose held groups live in the train state.

  The engine is reloaded from ``state.rollout_buffer`` and saved back after the call, and
  prompts are drawn lazily from the data sampler, so a resumed run continues exactly.
  Returns the Rollout (``group_meta`` = dataset indices) and the train-state updates.
  """
  engine.import_held(jax.device_get(state.rollout_buffer))
  position = [np.asarray(state.data)]

  def prompts():
    while True:
      e, p = (int(x) for x in position[0])
      idx, nxt = selection.sampler_next(
          selection.SamplerState(int(s.config.data.seed), e, p), len(s.train_examples), 1)
      position[0] = np.asarray([nxt.epoch, nxt.position], np.int32)
      i = int(idx[0])
      yield rollout.Prompt(_encode_prompts(s, [s.train_examples[i]])[0], meta=i)

  out = engine.rollout_groups(state.params, prompts(), s.config.train.batch_groups,
                              policy_version=int(state.step))
  held = jax.tree.map(jnp.asarray, engine.export_held(_held_capacity(s)))
  return out, {"data": position[0], "rollout_buffer": held}


def _split_groups(r: Rollouts, k: int) -> list[Rollouts]:
  size = r.tokens.shape[0] // k
  return [jax.tree.map(lambda a: a[i * size:(i + 1) * size], r) for i in range(k)]


# ------------------------------------------------------------------------------ the loop
class _Preempted:
  def __init__(self):
    self.flag = False

  def __call__(self, signum, frame):
    self.flag = True


def train(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True) -> TrainState:
  """Run (or resume) the configured training in ``workdir``; returns the final state."""
  s = build_setup(config)
  os.makedirs(workdir, exist_ok=True)
  c = config
  sft_steps, total = c.sft.steps, c.sft.steps + c.train.steps
  ckpt = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"), keep=c.train.keep,
                               save_every=c.train.checkpoint_every or total)
  latest = ckpt.latest_step()
  metrics_path = os.path.join(workdir, "metrics.jsonl")
  if latest is None:
    state = init_state(s)
    if os.path.exists(metrics_path):  # an earlier attempt died before its first checkpoint
      metrics_lib.truncate_after(metrics_path, 0)
  else:
    state, _ = ckpt.restore(abstract_state(s), step=latest)
    if os.path.exists(metrics_path):
      metrics_lib.truncate_after(metrics_path, latest)
  writer = metrics_lib.MetricsWriter(workdir, tensorboard=c.log.tensorboard)
  sft_step, rl_update = make_sft_step(s), make_rl_update(s)
  fns = {"logprob": make_logprob_fn(s), "values": make_value_fn(s), "engine": make_engine(s)}
  if s.objective.needs_grad_norms:
    fns["grad_norms"] = make_grad_norm_fn(s)
  preempted = _Preempted()
  old_handler = signal.signal(signal.SIGTERM, preempted)
  bar = _progress(progress, total, int(state.step))
  bad_steps = 0
  try:
    while int(state.step) < total:
      if preempted.flag:
        ckpt.save(int(state.step), state, force=True)
        ckpt.wait()
        print(f"SIGTERM: saved checkpoint at step {int(state.step)}; rerun to resume",
              file=sys.stderr)
        break
      step = int(state.step)
      t0 = time.perf_counter()
      if step < sft_steps:
        examples, data = _next_examples(s, np.asarray(state.data), c.sft.batch_size)
        tokens, attn, lmask = _sft_batch(s, examples)
        params, sft_opt, mets = sft_step(state.params, state.sft_opt_state, tokens, attn, lmask)
        state = state._replace(params=params, sft_opt_state=sft_opt)
        record = {"phase": "sft", **jax.device_get(mets)}
      else:
        if step == sft_steps and s.objective.needs_ref:
          state = state._replace(ref_params=jax.tree.map(jnp.copy, state.params))
        r, record, updates = rl_rollouts(s, state, fns)
        data = updates["data"]
        if "rollout_buffer" in updates:
          state = state._replace(rollout_buffer=updates["rollout_buffer"])
        carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
        mets_all = []
        for mb in _split_groups(r, c.train.minibatches):
          *carry, mets = rl_update(*carry, mb)
          mets_all.append(jax.device_get(mets))
        state = state._replace(params=carry[0], opt_state=carry[1], value_params=carry[2],
                               value_opt_state=carry[3])
        record = {"phase": "rl", **record,
                  **{k: float(np.mean([m[k] for m in mets_all])) for k in mets_all[0]}}
      skipped = int(record.get("update_skipped", 0))
      bad_steps = bad_steps + 1 if skipped else 0
      if bad_steps >= c.train.max_bad_steps:
        raise RLJaxError(f"{bad_steps} consecutive steps had a non-finite loss or gradient "
                         f"(last at step {step}); stopping. Lower optim.lr or check the data.")
      state = state._replace(step=state.step + 1, data=jnp.asarray(data))
      step += 1
      record["step_time_s"] = time.perf_counter() - t0
      if c.train.eval_every and (step % c.train.eval_every == 0 or step == total or
                                 step == sft_steps):
        record.update(evaluate(s, state.params, step))
      writer.write(step, record)
      _update_progress(bar, record)
      if ckpt.should_save(step) or step == total:
        ckpt.save(step, state, force=step == total)
    ckpt.wait()
    if int(state.step) >= total:
      models.save_hf(s.model_cfg, state.params, os.path.join(workdir, "hf"))
      metrics_lib.plot_curves(metrics_path, os.path.join(workdir, "curves.png"))
  finally:
    signal.signal(signal.SIGTERM, old_handler)
    writer.close()
    ckpt.close()
    if bar is not None:
      bar.close()
  return state


def _progress(enabled: bool, total: int, initial: int):
  if not enabled:
    return None
  from tqdm import tqdm  # pylint: disable=import-outside-toplevel
  return tqdm(total=total, initial=initial, dynamic_ncols=True, file=sys.stderr)


def _update_progress(bar, record: dict) -> None:
  if bar is None:
    return
  post = {}
  for key, short in (("sft_loss", "loss"), ("reward_mean", "reward"),
                     ("eval_accuracy", "acc"), ("rollout_tokens_per_s", "tok/s")):
    if key in record:
      post[short] = f"{record[key]:.3g}"
  bar.set_postfix(post, refresh=False)
  bar.update(1)


@config_utils.main_guard
def main(argv=None) -> None:
  config, workdir = config_utils.parse_cli(sys.argv if argv is None else argv)
  train(config, workdir)


if __name__ == "__main__":
  main()
