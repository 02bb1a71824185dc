"""Shared defaults for every rl_jax config: the sections and fields a trainer reads.

A config file starts from ``base_config()`` and changes what it needs::

    from configs import common

    def get_config(arg=None):
      config = common.base_config()
      config.model.num_layers = 2
      return config

Fields that may legitimately be None are typed placeholders, so a command-line override
still type-checks (``--config.model.hf_path=/ckpt/qwen3-0.6b``, ``--config.rollout.eos_id=2``).

Paper symbols next to fields: N samples per prompt (rollout.n), ε_low/ε_high clip range
(loss.eps_low/eps_high), β KL coefficient (loss.kl_beta), η learning rate (optim.lr).
"""

from __future__ import annotations

import ml_collections
from ml_collections import config_dict

from rl_jax import config_utils as cu
from rl_jax import losses

MESH_AXES = ("data", "fsdp", "sequence", "tensor")
SHARDING_RULES = ("replicated", "data", "fsdp", "fsdp_tp")
LOSS_PRESETS = tuple(sorted(losses.PRESETS))


def model_config() -> ml_collections.ConfigDict:
  """Either ``hf_path`` (an HF checkpoint directory) or the architecture fields."""
  return ml_collections.ConfigDict(dict(
      hf_path=config_dict.placeholder(str),  # If set, the fields below come from config.json.
      architecture="llama",  # llama | qwen2 | qwen3
      vocab_size=256,
      hidden_size=64,
      intermediate_size=128,
      num_layers=2,
      num_heads=4,
      num_kv_heads=2,
      head_dim=16,
      rope_theta=10000.0,
      max_position_embeddings=1024,
      tie_word_embeddings=False,
      init_std=0.02,  # random init (when hf_path is None)
      dtype="float32",  # compute dtype
      param_dtype="float32",  # storage dtype of the weights
      remat="none",  # none | full | dots
  ))


def mesh_config() -> ml_collections.ConfigDict:
  """Mesh shape over (data, fsdp, sequence, tensor); -1 takes the remaining devices."""
  return ml_collections.ConfigDict(dict(
      shape=dict(data=1, fsdp=-1, sequence=1, tensor=1),
      rules="fsdp",  # a key of rl_jax.sharding.RULES
      num_devices=0,  # use the first k devices (0: all)
  ))


def data_config() -> ml_collections.ConfigDict:
  """Prompt source: a built-in task, or a JSONL / Parquet file (task="file")."""
  return ml_collections.ConfigDict(dict(
      task="arithmetic",  # arithmetic | countdown | sorting (built in), or "file" (data.path)
      path=config_dict.placeholder(str),  # .jsonl or .parquet file when task is "file"
      tokenizer=config_dict.placeholder(str),  # None: the task's own tokenizer
      difficulty=0,  # the task's difficulty knob
      format="auto",  # file tasks: gsm8k | math | auto
      eval_path=config_dict.placeholder(str),  # file tasks: held-out file (None: hash split)
      template="{question}",  # file tasks: prompt template
      max_prompt_len=64,
      eval_size=128,
      reward_timeout_s=5.0,  # per verifier call; a time-out scores 0 and is counted
      seed=0,
  ))


def rollout_config() -> ml_collections.ConfigDict:
  """Sampling for training rollouts (N samples per prompt)."""
  return ml_collections.ConfigDict(dict(
      n=8,  # N, samples per prompt (group size)
      max_new_tokens=32,
      temperature=1.0,  # 0 means greedy
      top_p=1.0,
      top_k=0,  # 0 disables top-k
      eos_id=config_dict.placeholder(int),  # None: the tokenizer's EOS
      # Active partial rollouts (APRIL): keep ceil(over_sampling·batch_groups) groups in
      # flight, train on the first batch_groups that complete, carry the rest (with their
      # tokens, behaviour log-probs and policy versions) into the next step.
      partial=False,
      over_sampling=2.0,
      max_staleness=1,  # η: no token more than η policy versions old; -1 = unbounded
      mask_stale=False,  # drop tokens sampled by an older policy from the loss
  ))


def loss_config() -> ml_collections.ConfigDict:
  """A named preset of ``rl_jax.losses`` plus knobs that override it (None: the preset's)."""
  return ml_collections.ConfigDict(dict(
      preset="grpo",
      advantage=config_dict.placeholder(str),  # grpo | dr_grpo | rloo | mc_grpo | ...
      eps_low=config_dict.placeholder(float),  # ε_low
      eps_high=config_dict.placeholder(float),  # ε_high (DAPO clip-higher: 0.28)
      dual_clip=config_dict.placeholder(float),  # c of dual-clip PPO
      agg=config_dict.placeholder(str),  # token-mean | seq-mean-token-mean | ...
      kl_beta=config_dict.placeholder(float),  # β of the KL loss term (0 disables)
      kl_kind=config_dict.placeholder(str),  # k1 | k2 | k3 | abs
      entropy_coef=config_dict.placeholder(float),
      tis_level=config_dict.placeholder(str),  # token | sequence truncated IS vs sampler
      tis_cap=config_dict.placeholder(float),  # C of truncated IS
  ))


def loss_extra_config() -> ml_collections.ConfigDict:
  """Trainer-side settings of objectives (not knobs of the loss itself)."""
  return ml_collections.ConfigDict(dict(
      grad_norm_method="map",  # VCPO per-trajectory gradient norms: vmap | map | jvp
      grad_norm_chunk=4,  # rows per chunk of "map" (docs/BENCHMARKS.md: grad-norm section)
  ))


def optim_config() -> ml_collections.ConfigDict:
  """AdamW with linear warmup then constant or cosine decay."""
  return ml_collections.ConfigDict(dict(
      lr=1e-5,  # η
      schedule="constant",  # constant | cosine
      warmup_steps=0,
      b1=0.9,
      b2=0.999,
      eps=1e-8,
      weight_decay=0.0,
      grad_clip=1.0,  # global-norm clip; 0 disables
      value_lr=config_dict.placeholder(float),  # PPO critic learning rate (None: lr)
  ))


def train_config() -> ml_collections.ConfigDict:
  """Loop sizes, seeding, evaluation and checkpoint cadence."""
  return ml_collections.ConfigDict(dict(
      steps=100,
      batch_groups=8,  # prompts (groups) per step; each has rollout.n samples
      minibatches=1,  # optimizer updates per step
      shared_prefix=True,  # packed prompt-once layout for grouped log-probs (DualKV)
      max_bad_steps=3,  # consecutive non-finite losses before the run stops
      seed=0,
      eval_every=50,  # 0 disables evaluation
      checkpoint_every=50,  # 0 saves only at the end
      keep=3,  # checkpoints kept
  ))


def sft_config() -> ml_collections.ConfigDict:
  """Supervised warm start on prompt/answer pairs before RL (0 steps disables it)."""
  return ml_collections.ConfigDict(dict(
      steps=0,
      lr=1e-4,
      batch_size=32,
  ))


def eval_config() -> ml_collections.ConfigDict:
  """Held-out evaluation: greedy accuracy, and pass@k with k samples (0 disables)."""
  return ml_collections.ConfigDict(dict(
      pass_k=0,
  ))


def log_config() -> ml_collections.ConfigDict:
  """Metrics output."""
  return ml_collections.ConfigDict(dict(
      tensorboard=True,  # DIR/tensorboard event files (tensorboardX)
  ))


def base_config() -> ml_collections.ConfigDict:
  """The full default config tree (unlocked): model, mesh, data, rollout, loss, optim,
  train, log."""
  return ml_collections.ConfigDict(dict(
      model=model_config(),
      mesh=mesh_config(),
      data=data_config(),
      rollout=rollout_config(),
      loss=loss_config(),
      loss_extra=loss_extra_config(),
      optim=optim_config(),
      train=train_config(),
      sft=sft_config(),
      eval=eval_config(),
      log=log_config(),
  ))


def checks() -> dict[str, cu.Check | tuple[cu.Check, ...]]:
  """Value-range checks of the shared fields, for ``config_utils.validate(config, checks())``."""
  return {
      "model.architecture": cu.one_of(("llama", "qwen2", "qwen3")),
      "model.num_layers": cu.positive_int,
      "model.remat": cu.one_of(("none", "full", "dots")),
      "mesh.rules": cu.one_of(SHARDING_RULES),
      "mesh.num_devices": cu.nonnegative_int,
      "data.max_prompt_len": cu.positive_int,
      "rollout.n": cu.positive_int,
      "rollout.max_new_tokens": cu.positive_int,
      "rollout.temperature": cu.nonnegative,
      "rollout.top_p": (cu.probability, cu.in_range(0.0, 1.0, low_inclusive=False)),
      "rollout.top_k": cu.nonnegative_int,
      "rollout.over_sampling": cu.in_range(1.0, None),
      "rollout.max_staleness": cu.in_range(-1, None),
      "loss.preset": cu.one_of(LOSS_PRESETS),
      "loss.eps_low": cu.optional(cu.nonnegative),
      "loss.eps_high": cu.optional(cu.nonnegative),
      "loss.kl_beta": cu.optional(cu.nonnegative),
      "optim.lr": cu.positive,
      "loss_extra.grad_norm_method": cu.one_of(("vmap", "map", "jvp")),
      "loss_extra.grad_norm_chunk": cu.positive_int,
      "optim.schedule": cu.one_of(("constant", "cosine")),
      "optim.warmup_steps": cu.nonnegative_int,
      "optim.weight_decay": cu.nonnegative,
      "optim.grad_clip": cu.nonnegative,
      "train.steps": cu.positive_int,
      "train.batch_groups": cu.positive_int,
      "train.minibatches": cu.positive_int,
      "train.eval_every": cu.nonnegative_int,
      "train.checkpoint_every": cu.nonnegative_int,
      "train.keep": cu.positive_int,
      "sft.steps": cu.nonnegative_int,
      "sft.lr": cu.positive,
      "sft.batch_size": cu.positive_int,
      "eval.pass_k": cu.nonnegative_int,
      "train.max_bad_steps": cu.positive_int,
  }
