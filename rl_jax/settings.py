"""Typed settings: config sections as frozen, self-checking dataclasses.

The ``ml_collections.ConfigDict`` of ``rl_jax.config`` stays the surface of config files and
the command line. A section with settings here has one home: each field's default, its
value check and its doc are declared on the field, ``rl_jax.config`` builds the section's
``ConfigDict`` (``section_config``) and its check table (``section_checks``) from them, and
the rules between fields of the section are the dataclass's ``__post_init__``. The setup
turns the section into its settings once (``from_section``: ``Setup.rollout`` ...); the code
below the setup reads those instead of the raw config (``tests/test_settings.py`` names the
few modules that still take a whole config), and a function that needs a few of them takes
those, so its signature says what it depends on.

* ``RolloutSettings``: ``config.rollout``, sampling for training rollouts.
* ``TrainSettings`` (with ``ReplaySettings``): ``config.train``, the loop, its mode and
  cadence, the CPU compile options.
* ``SftSettings``, ``EvalSettings``, ``DistillSettings``, ``LogSettings``, ``OptimSettings``,
  ``LossExtraSettings``, ``RewardSettings``: ``config.sft``, ``eval``, ``distill``, ``log``,
  ``optim``, ``loss_extra``, ``reward``.
* ``DataSettings``, ``EnvSettings``: ``config.data`` (the prompts, their selection and group
  sizes) and ``config.env`` (multi-turn environments).
* ``MeshSettings``, ``DistributedSettings``, ``DryRunSettings``: ``config.mesh``,
  ``distributed`` and ``dry_run`` (the devices, the processes, a TPU topology to compile for).

* ``ModelSettings`` (with ``LoraSettings``): ``config.model``, the policy model, which the
  setup turns into ``rl_jax.models.ModelConfig`` (from these fields or the checkpoint's
  config.json).

``SECTIONS`` maps each section to its class; ``SETUP_SECTIONS`` names those the setup holds.
The ``loss`` section is the knobs of ``rl_jax.losses`` (``losses.KNOBS``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import ml_collections
from ml_collections import config_dict

from rl_jax import config_checks as cu
from rl_jax import imports
from rl_jax import losses, optim
from rl_jax import sharding
from rl_jax.errors import ConfigError
from rl_jax.models import config as model_config_lib
from rl_jax.models import lora as lora_lib
from rl_jax.models import moe

__all__ = ["ENV_ADAPTERS", "ENV_TASKS", "GROUP_FNS", "GROUP_SIZES", "GYM_CODECS",
           "JUDGE_VERDICTS", "OFFLOAD_PARTS", "OLD_LOGP_PASSES", "SECTIONS", "SELECTORS",
           "SETUP_SECTIONS", "TOOL_FORMATS", "DataSettings", "DistillSettings",
           "DistributedSettings", "DryRunSettings", "EnvSettings", "EvalSettings", "LogSettings",
           "LoraSettings", "LossExtraSettings", "MeshSettings", "ModelSettings", "OptimSettings",
           "ReplaySettings", "RewardSettings", "RolloutSettings", "SftSettings", "TrainSettings",
           "from_section", "section_checks", "section_config", "setting"]


def setting(default: Any, check: Any = None, doc: str = "", *, kind: type | None = None):
  """A settings field: ``default`` (a callable is called for each new settings value: a
  nested settings class, a default read from the environment), ``check`` (an
  ``rl_jax.config_checks`` check, or a tuple of them, run on the value before the settings
  are built), ``doc`` (its meaning); ``kind``: the type of a field whose default is None,
  or that may be set to None (how the command line parses it, ``none`` included)."""
  metadata = {"check": check, "doc": doc, "kind": kind}
  if callable(default):
    return dataclasses.field(default_factory=default, metadata=metadata)
  return dataclasses.field(default=default, metadata=metadata)


OFFLOAD_PARTS = ("optimizer", "reference", "teacher")  # train.offload (rl_jax.train.offload)
OLD_LOGP_PASSES = ("auto", "separate")  # train.old_logp_pass (rl_jax.train.on_policy)


_BOOL = cu.one_of((False, True))  # the check of a boolean field


def _int(x: Any) -> str | None:
  return None if cu.is_int(x) else "must be an int"


@dataclasses.dataclass(frozen=True)
class RolloutSettings:
  """Sampling for training rollouts (M samples per prompt): ``config.rollout``.

  Symbols: M = ``n``, R = ``max_new_tokens`` (single-turn runs), η = ``max_staleness``
  (AReaL's staleness bound), l = ``spec_lenience`` (SPEC-RL).
  """

  n: int = setting(8, cu.positive_int, "M, samples per prompt (group size)")
  max_new_tokens: int = setting(32, cu.positive_int, "R, the response budget of a sample")
  temperature: float = setting(1.0, cu.nonnegative, "0 means greedy")
  top_p: float = setting(1.0, (cu.probability, cu.in_range(0.0, 1.0, low_inclusive=False)),
                         "nucleus sampling mass; 1.0 disables it")
  top_k: int = setting(0, cu.nonnegative_int, "0 disables top-k")
  eos_id: int | None = setting(None, None, "None: the tokenizer's EOS", kind=int)
  partial: bool = setting(
      False, _BOOL,
      "Active partial rollouts (APRIL): keep ceil(over_sampling * batch_groups) groups in "
      "flight, train on the first batch_groups that complete, carry the rest (with their "
      "tokens, behaviour log-probs and policy versions) into the next step")
  over_sampling: float = setting(2.0, cu.in_range(1.0, None),
                                 "groups in flight per trained group (rollout.partial)")
  partial_shares: int = setting(
      0, cu.nonnegative_int,
      "Engine shares: the step's groups split into this many independent APRIL engines "
      "(each its own batch_groups / shares groups, held groups and prompt stream); with "
      "several processes each runs and holds only its own shares. 0: one per process. Runs "
      "with the same shares give the same batches on any number of processes")
  max_staleness: int = setting(
      1, cu.in_range(-1, None),
      "η: no token more than η policy versions old, for partial rollouts and the free-running "
      "producer (train.async_lag=-1); -1 = unbounded")
  mask_stale: bool = setting(False, _BOOL,
                             "drop tokens sampled by an older policy from the loss")
  speculative: bool = setting(
      False, _BOOL,
      "SPEC-RL: the previous response of the same prompt is a draft, verified by the "
      "current policy (exact speculative sampling; docs/SELECTION.md)")
  spec_lenience: float = setting(0.0, cu.nonnegative,
                                 "l: accept with min(1, e^l p_new/p_old); 0 is exact")
  lora_merge: bool = setting(
      True, _BOOL,
      "LoRA (model.lora.rank > 0): the sampler decodes merged weights W + (alpha/r)·A·B, "
      "merged once per policy version (faster on the measured CPU: docs/BENCHMARKS.md); "
      "False decodes the base and the adapters unmerged (no merged copy of the weights); "
      "with model.lora.quant the sampler always decodes the quantised base unmerged")
  weight_dtype: str = setting(
      "", cu.one_of(model_config_lib.SAMPLER_QUANTS),
      'Weights the sampler decodes with: "" the trainer\'s (model.dtype); "int8" or "fp8" '
      "(float8_e4m3fn) quantises every dense projection, a scale per head_dim entries, "
      "while the trainer keeps its dtype (rl_jax.train.layout; mismatch_* metrics show the "
      "gap)")
  sampler_copy: bool | None = setting(
      None, cu.optional(_BOOL),
      "The sampler decodes from a copy of the policy whose projection matrices are cast to "
      "the compute dtype (model.dtype) once per policy version: the same samples bit for "
      "bit, and with float32 weights decoded in bfloat16 half the weight bytes each decode "
      "step reads, for the copy's memory. None: auto (on for TPU and GPU programs, where "
      "decode is bound by memory bandwidth; off for CPU ones). A sampler on devices or "
      "processes of its own always decodes from such a copy", kind=bool)
  page_size: int = setting(
      64, cu.power_of_two,
      "The paged response cache (rl_jax/rollout/pages.py): tokens per page, a power of two "
      "(>= max_new_tokens: one worst-case page per sample, the unpaged layout)")
  prompt_pages: bool = setting(
      False, _BOOL,
      "A prompt's ids after its first go onto pool pages, written once per group and taken "
      "by its other samples by reference count (the partial last page copied), so prompt KV "
      "follows the prompts' lengths instead of data.max_prompt_len per slot; the same tokens, "
      "log-probs equal to float rounding (rl_jax/rollout/engine.py); the decode reads the "
      "shared pages once per group. Single-turn, speculative and multi-turn rollouts (with "
      "env.name, the first prompt; groups whose prompts begin alike, e.g. one system "
      "prompt, share its pages on a pool shard). Off: the prompt in each slot's own cache, "
      "read in place, faster where prompts are short (the quickstart takes 1.16x as long "
      "with the flag; docs/BENCHMARKS.md compares the two)")
  kv_pages: int | None = setting(
      None, cu.optional(cu.positive_int),
      "Pool pages per device, fixed: the pool is split over the devices the batch axes split "
      "the group slots over, each shard serving its own slots; when a shard's pages run out "
      "its newest group is preempted and resumed by recompute (the same tokens; multi-turn "
      "runs too, partial turns kept). At least one group's whole budget. None: from "
      "rollout.kv_memory_fraction where the device reports its memory, else the pool grows "
      "as the responses need it (never preempts)",
      kind=int)
  kv_memory_fraction: float | None = setting(
      None, cu.optional(cu.in_range(0.0, 1.0, low_inclusive=False)),
      "Fraction of the device memory free when the engine starts that the pool takes (GPU, "
      "TPU; ignored where the device reports no capacity, e.g. CPU). None: grow as needed",
      kind=float)
  prefill_chunk: int = setting(
      2048, cu.power_of_two,
      "Prompts longer than this many tokens (a power of two) are prefilled in chunks of it: "
      "attention scores [chunk, prompt] per head at a time instead of [prompt, prompt] "
      "(rl_jax/rollout/prefill.py); preempted, evicted or held samples are re-prefilled in "
      "chunks of it too (scores [chunk, prompt + budget]), in calls of at most the slots x "
      "min(prompt bucket, chunk) positions (rl_jax/rollout/slots.py); equal to float "
      "rounding")

  def __post_init__(self):
    if self.speculative and not self.temperature > 0:
      raise ConfigError("rollout.speculative=True needs rollout.temperature > 0 (greedy "
                        "decoding has nothing to verify)")
    if self.speculative and self.partial:
      raise ConfigError("rollout.speculative=True and rollout.partial=True cannot be "
                        "combined; choose one")

  @property
  def sample_temperature(self) -> float:
    """The temperature the sampler's log-probs are taken at: ``temperature``, or 1 for greedy
    decoding (its log-probs are the plain softmax's)."""
    return self.temperature or 1.0


def _async_lag(x: Any) -> str | None:
  return None if cu.is_int(x) and x >= -1 else "must be an int >= 0, or -1 (free-running)"


def _compile_cache() -> str:
  """``train.compile_cache``'s default, read when a config is built: the environment
  variable RL_JAX_COMPILE_CACHE (one cache for every run on a machine, e.g. a test suite),
  else "compile_cache" under the workdir."""
  return os.environ.get("RL_JAX_COMPILE_CACHE", "compile_cache")


@dataclasses.dataclass(frozen=True)
class ReplaySettings:
  """Experience replay (``train.replay``; rl_jax.train.replay_stage, docs/ALGORITHMS.md,
  "Experience replay")."""

  capacity: int = setting(
      0, cu.nonnegative_int,
      "a ring of the last ``capacity`` scored groups with reward variance (0: off)")
  fraction: float = setting(
      0.25, cu.in_range(0.0, 1.0, high_inclusive=False),
      "once the ring holds round(fraction * batch_groups) groups, each step draws that many "
      "from it and samples only the rest of its batch_groups fresh")


@dataclasses.dataclass(frozen=True)
class TrainSettings:
  """Loop sizes, seeding, evaluation and checkpoint cadence, the training mode and the
  CPU compile options: ``config.train``. G = ``batch_groups``, μ = ``epochs``."""

  steps: int = setting(100, cu.positive_int, "RL steps of the run")
  batch_groups: int = setting(
      8, cu.positive_int, "G, prompts (groups) per step; each has rollout.n samples")
  minibatches: int = setting(1, cu.positive_int, "optimizer updates per step (per epoch)")
  epochs: int = setting(
      1, cu.positive_int,
      "μ: passes over each step's batch (PPO epochs), minibatches reshuffled per pass; the "
      "proximal log-probs are computed once, before the first pass (rl_jax.train.learner)")
  micro_batches: int = setting(
      1, cu.positive_int,
      "gradient accumulation: each minibatch's groups in this many micro-batches, one after "
      "another inside the update (the same update to float rounding, less activation memory)")
  shared_prefix: bool = setting(True, _BOOL,
                                "packed prompt-once layout for grouped log-probs")
  trim_floor: int = setting(
      1024, cu.nonnegative_int,
      "the learner's passes run on each step's responses cut to the smallest power of two "
      "of tokens, at least this many, that holds the step's longest response (at most the "
      "response budget): what follows every response is padding, so the update's cost "
      "follows the tokens generated; one program per length (rl_jax.train.learner). 0: "
      "every step at the full budget")
  pack_floor: int = setting(
      128, cu.nonnegative_int,
      "from this trained length on, the learner's passes and update pack several "
      "short responses into one row of the prompt-once layout (first-fit decreasing; each "
      "attends only to its prompt and itself) when that saves a quarter of the rows: their "
      "rows follow the tokens generated (rl_jax.models.packing; the \"concat\" response "
      "attention, so CPUs, dense models without sliding windows). 0: off")
  max_bad_steps: int = setting(
      3, cu.positive_int,
      "consecutive skipped updates (non-finite loss or grad norm), then the run stops")
  seed: int = setting(0, _int, "the run's seed; every random stream derives from it")
  eval_every: int = setting(50, cu.nonnegative_int, "0 disables evaluation")
  checkpoint_every: int = setting(50, cu.nonnegative_int, "0 saves only at the end")
  keep: int = setting(3, cu.positive_int, "checkpoints kept")
  lock_stale_s: int = setting(
      300, cu.positive_int,
      "a lock whose holder runs on another host is stale after this many seconds without a "
      "heartbeat (rl_jax.train.lock); a holder on this host is stale once its pid is gone")
  ref_dtype: str | None = setting(
      None, cu.optional(cu.one_of(model_config_lib.DTYPES)),
      "storage dtype of the frozen KL reference (None: model.dtype, the compute dtype)",
      kind=str)
  offload: str = setting(
      "", None,
      'state parts kept in host memory between steps (JAX memory kind "pinned_host"): "" or '
      'comma-separated names of "reference", "optimizer", "teacher" (the on-policy '
      "distillation teacher) (rl_jax.train.offload)")
  dry_run: bool = setting(
      False, _BOOL,
      "print the memory plan (abstract shapes, no weights read) and exit; with "
      "dry_run.topology, compile every program for that TPU topology")
  memory_check: bool = setting(
      True, _BOOL,
      "fail before compiling when the memory plan exceeds the devices")
  mode: str = setting(
      "sync", cu.one_of(("sync", "async")),
      '"sync": sample, then update. "async": a rollout producer samples on its own devices '
      "(mesh.rollout_devices) while the learner updates (rl_jax.train.runner)")
  async_lag: int = setting(
      1, _async_lag,
      "async only: the batch of step t comes from the weights of step t - async_lag (a "
      "reproducible, resumable pipeline; 0 equals sync). -1: free-running producer, bounded "
      "by rollout.max_staleness")
  allow_uncorrected: bool = setting(
      False, _BOOL,
      "async: allow a lag above 1 (or train.replay) with an objective that ignores the "
      "behaviour log-probs (plain GRPO on stale data, for ablations)")
  replay: ReplaySettings = setting(ReplaySettings, None, "experience replay")
  old_logp_pass: str = setting(
      "auto", cu.one_of(OLD_LOGP_PASSES),
      '"auto": with one minibatch (on-policy) the update takes old_logp from its own policy '
      'pass instead of a separate one (rl_jax.train.on_policy); "separate": always a pass')
  compile_cache: str = setting(
      _compile_cache, None,
      "JAX's persistent compilation cache: relative paths are under the workdir (a rerun or "
      "resume loads its programs), an absolute one can be shared by runs; \"\" disables it. "
      "The environment variable RL_JAX_COMPILE_CACHE, when set, replaces the default")
  cpu_fast_compile: bool = setting(
      True, _BOOL,
      "CPU only: compile the training programs and the sampler's prefill with XLA's "
      "elemental emitter and LLVM -O1 (rl_jax.compile_options): about half the compile time "
      "for them, values equal to XLA's defaults to float rounding. False: XLA's defaults")
  cpu_xla_reductions: bool = setting(
      True, _BOOL,
      "CPU only: the training programs' reductions as XLA's own loops, not YNNPACK's "
      "(rl_jax.compile_options): the RL update about 1.1x faster on a small model; sums in "
      "another order, values equal to float rounding. False: XLA's defaults")
  cpu_temp_block_mib: int = setting(
      0, cu.nonnegative_int,
      "CPU only, opt-in: the training programs' temporaries in blocks of at most this many "
      "MiB (16 suits glibc; rl_jax.compile_options), which malloc reuses between calls "
      "instead of mapping and faulting in one large block each time: the RL update up to "
      "1.08x faster on a small model, values bit-identical; programs in several blocks are "
      "not stored in the compilation cache. 0: one block, XLA's default")
  profile_step: int = setting(
      0, cu.nonnegative_int, "write a jax.profiler trace of this step to DIR/profile (0: none)")

  def __post_init__(self):
    unknown = sorted(n for n in self.offload_parts if n not in OFFLOAD_PARTS)
    if unknown:
      raise ConfigError(f"config.train.offload names {unknown[0]!r}; choose from "
                        f"{sorted(OFFLOAD_PARTS)} (comma-separated), or '' for none")
    r, k = self.replay, self.replay_groups
    what = f"train.replay.capacity={r.capacity}"
    if r.capacity and k == 0:
      raise ConfigError(f"{what}: train.replay.fraction={r.fraction} of "
                        f"train.batch_groups={self.batch_groups} rounds to 0 replayed groups")
    if r.capacity and r.capacity < k:
      raise ConfigError(f"{what} holds fewer groups than a step replays (round(fraction x "
                        f"batch_groups) = {k})")

  @property
  def replay_groups(self) -> int:
    """k: the groups a step of experience replay takes from its buffer once it holds that
    many, round(replay.fraction · G) (halves up); 0 with replay off."""
    if not self.replay.capacity:
      return 0
    return int(self.replay.fraction * self.batch_groups + 0.5)

  @property
  def offload_parts(self) -> tuple[str, ...]:
    """``offload``'s names, sorted, each once."""
    return tuple(sorted({n.strip() for n in (self.offload or "").split(",") if n.strip()}))


@dataclasses.dataclass(frozen=True)
class SftSettings:
  """Supervised warm start on prompt/answer pairs before RL: ``config.sft``."""

  steps: int = setting(0, cu.nonnegative_int, "supervised steps before RL; 0 disables it")
  lr: float = setting(1e-4, cu.positive, "its learning rate")
  batch_size: int = setting(32, cu.positive_int, "prompt/answer pairs per step")


@dataclasses.dataclass(frozen=True)
class EvalSettings:
  """Held-out evaluation: greedy accuracy, and pass@k with k samples: ``config.eval``."""

  pass_k: int = setting(0, cu.nonnegative_int, "k of pass@k; 0 disables it")
  share_programs: bool = setting(
      True, _BOOL,
      "sample through the training rollouts' compiled programs (M greedy rows per prompt "
      "instead of one; fewer programs to compile; rl_jax.train.evaluation)")


@dataclasses.dataclass(frozen=True)
class DistillSettings:
  """On-policy distillation (``rl_jax.train.teacher``): a frozen teacher scores the tokens
  the policy samples, and ``coef`` x (teacher log-prob - sampler log-prob) is each token's
  advantage, added to the task's (any preset) or alone (``loss.preset=on_policy_distill``):
  ``config.distill``."""

  teacher_path: str = setting(
      "", None, 'HF checkpoint directory of the teacher (same vocabulary); "" = off')
  coef: float = setting(1.0, cu.positive, "weight of the per-token reverse-KL advantage")


@dataclasses.dataclass(frozen=True)
class LogSettings:
  """Metrics output: ``config.log``."""

  tensorboard: bool = setting(True, _BOOL,
                              "DIR/tensorboard event files (tensorboardX)")
  wandb: bool = setting(False, _BOOL,
                        "also log to Weights & Biases (needs `pip install wandb`)")
  wandb_project: str = setting("rl_jax", None, "the W&B project")
  wandb_name: str | None = setting(None, None, "None: W&B picks a run name", kind=str)


_MOMENT = cu.in_range(0.0, 1.0, high_inclusive=False)  # Adam's decay rates β1, β2


@dataclasses.dataclass(frozen=True)
class OptimSettings:
  """AdamW with linear warm-up then constant or cosine decay (``rl_jax.optim``):
  ``config.optim``. η = ``lr``. Schedules count optimizer updates: a stage of S steps takes
  S x ``train.minibatches`` x ``train.epochs`` of them (RL), or S (supervised), and the
  cosine decays to 0 over them."""

  lr: float = setting(1e-5, cu.positive, "η, the policy's learning rate")
  schedule: str = setting("constant", cu.one_of(optim.SCHEDULES),
                          "one of rl_jax.optim.SCHEDULES")
  warmup_steps: int = setting(
      0, cu.nonnegative_int,
      "linear warm-up, in optimizer updates (train.minibatches x train.epochs per RL step, "
      "one per supervised step)")
  b1: float = setting(0.9, _MOMENT, "Adam's β1")
  b2: float = setting(0.999, _MOMENT, "Adam's β2")
  eps: float = setting(1e-8, cu.positive, "Adam's ε (> 0: an all-zero gradient divides by it)")
  weight_decay: float = setting(0.0, cu.nonnegative, "decoupled weight decay")
  grad_clip: float = setting(1.0, cu.nonnegative, "global-norm clip; 0 disables it")
  value_lr: float | None = setting(None, cu.optional(cu.positive),
                                   "PPO critic learning rate (None: lr)", kind=float)
  mu_dtype: str | None = setting(None, cu.optional(cu.one_of(model_config_lib.DTYPES)),
                                 "Adam first moment dtype (None: param dtype)", kind=str)
  stochastic_rounding: bool = setting(
      False, _BOOL,
      "with model.param_dtype=bfloat16: add each update in float32 and round the weights "
      "back to bfloat16 stochastically (unbiased), instead of to nearest (rl_jax.optim)")


@dataclasses.dataclass(frozen=True)
class LossExtraSettings:
  """Trainer-side settings of objectives, not knobs of the loss itself:
  ``config.loss_extra``."""

  grad_norm_method: str = setting(
      "map", cu.one_of(losses.GRAD_NORM_METHODS),
      "VCPO per-trajectory gradient norms; rl_jax.losses.GRAD_NORM_METHODS")
  grad_norm_chunk: int = setting(
      4, cu.positive_int, 'rows per chunk of "map" (docs/BENCHMARKS.md: grad-norm section)')


GROUP_FNS = ("majority_vote",)  # reward.group_fn built-ins (rl_jax.data.group_rewards)
JUDGE_VERDICTS = ("yes_no", "score")  # reward.judge_verdict (rl_jax.train.judge_stage)


def _group_fn(x: Any) -> str | None:
  if x in ("",) + GROUP_FNS or imports.is_import_path(x):
    return None
  return f"must be '', a built-in {GROUP_FNS} or an import path module:fn (e.g. my_rewards:vote)"


def _str(what: str):
  return lambda x: None if isinstance(x, str) else f"must be {what} (str)"


@dataclasses.dataclass(frozen=True)
class RewardSettings:
  """Rewards that are not a per-row rule: ``config.reward``. A group function
  (``rl_jax.data.group_rewards``) scores the M completions of each prompt together, once
  per group; a judge model (``rl_jax.train.judge_stage``) scores each completion from a
  prompt rendered by a jinja2 template. Either one's rewards replace the task verifier's
  for training (evaluation keeps the verifier)."""

  group_fn: str = setting(
      "", _group_fn,
      '"" = the task\'s verifier per row; a built-in ("majority_vote": test-time RL\'s '
      'label-free majority vote) or "module:fn", fn(completions, example) -> M rewards')
  judge_path: str = setting(
      "", _str("a directory"),
      "HF checkpoint directory (config.json, safetensors, tokenizer.json) of a judge; "
      '"" = off')
  judge_template: str = setting(
      "", _str("a jinja2 template file"),
      "jinja2 template file of the judge's prompt (variables: question, answer, reference)")
  judge_verdict: str = setting(
      "yes_no", cu.one_of(JUDGE_VERDICTS),
      '"yes_no": P(yes)/(P(yes)+P(no)) of the judge\'s next token; "score": the first '
      "number of its greedy continuation of up to judge_max_tokens tokens")
  judge_max_tokens: int = setting(8, cu.positive_int, "the judge's longest continuation")

  def __post_init__(self):
    fn, judge, template = self.group_fn, self.judge_path, self.judge_template
    if judge and not template:
      raise ConfigError(f"reward.judge_path={judge} needs reward.judge_template=FILE.jinja "
                        "(the judge's prompt, rendered from question, answer and reference)")
    if template and not judge:
      raise ConfigError(f"reward.judge_template={template} needs reward.judge_path=HF_DIR "
                        "(the judge model that reads the rendered prompt)")
    if judge and fn:
      raise ConfigError(f"reward.judge_path={judge} and reward.group_fn={fn!r} cannot be "
                        "combined: each replaces the verifier's reward; set one")


# config section -> its settings class: ``rl_jax.config`` builds these sections from them
# and ``Setup`` holds each as the attribute of the section's name

SELECTORS = ("none", "dapo", "greso", "beta")  # data.selector (rl_jax.train.selection_stage)
GROUP_SIZES = ("fixed", "adaptive")  # data.group_size


@dataclasses.dataclass(frozen=True)
class DataSettings:
  """The prompts of a run: a built-in task or a JSONL / Parquet file (``task="file"``),
  which prompts a step trains on (``selector``) and how many samples each gets
  (``group_size``; docs/SELECTION.md): ``config.data``. A multi-turn run (``env.name``) takes
  its prompts from the environment and reads ``seed``, ``eval_size``, ``tokenizer`` and (for
  ``math_tools``) the file fields from here."""

  task: str = setting("arithmetic", None,
                      "arithmetic | countdown | sorting (built in), or 'file' (data.path)")
  path: str | None = setting(None, None, ".jsonl or .parquet file when task is 'file'",
                             kind=str)
  tokenizer: str | None = setting(
      None, None, "a tokenizer directory; None: the model's (model.hf_path), else characters",
      kind=str)
  difficulty: int = setting(0, None, "the built-in task's difficulty knob")
  format: str = setting("auto", None, "file tasks: gsm8k | math | auto")
  eval_path: str | None = setting(None, None, "file tasks: held-out file (None: hash split)",
                                  kind=str)
  template: str = setting("{question}", None,
                          "file tasks: prompt template; its one field is {question}")
  max_prompt_len: int = setting(64, cu.positive_int,
                                "the longest prompt allowed, in tokens (a longer one is an error)")
  eval_size: int = setting(128, cu.nonnegative_int, "held-out prompts evaluated")
  reward_timeout_s: float = setting(
      5.0, cu.positive, "seconds per verifier call; a time-out scores 0 and is counted")
  seed: int = setting(0, None, "the seed of a built-in task's examples and of the prompt stream")
  selector: str = setting(
      "none", cu.optional(cu.one_of(SELECTORS)),
      'Prompt selection: "none" | "dapo" (dynamic sampling: keep only groups whose rewards '
      'differ) | "greso" (skip prompts whose recent groups had zero reward variance) | '
      '"beta" (per-prompt Beta posterior). With loss.preset="dapo", "none" means "dapo". '
      "None (--config.data.selector=none on the command line) is read as \"none\"", kind=str)
  max_tries: int = setting(
      10, cu.positive_int, "dapo: candidate batches per step; greso: candidate batches to draw")
  select_pool: float = setting(
      2.0, cu.in_range(1.0, None),
      "beta: candidates drawn per step, as a multiple of train.batch_groups")
  beta_mode: str = setting(
      "thompson", cu.one_of(("thompson", "variance")),
      'beta: "thompson" (sample closest to 0.5) | "variance" (mu(1-mu))')
  beta_decay: float = setting(0.9, cu.probability,
                              "beta: lambda of the decay toward the Beta(1, 1) prior")
  group_size: str = setting(
      "fixed", cu.one_of(GROUP_SIZES),
      'Samples per prompt: "fixed" (rollout.n each) | "adaptive" (the budget batch_groups * '
      "rollout.n is cut into chunks of group_chunk samples and each prompt gets >= 1 chunk "
      "from its Beta posterior; more where mixed rewards are likely to need more samples)")
  group_chunk: int | None = setting(
      None, cu.optional(cu.positive_int), "adaptive: m samples per chunk (None: n // 2)",
      kind=int)
  group_max: int | None = setting(
      None, cu.optional(cu.positive_int), "adaptive: most samples per prompt (None: any)",
      kind=int)
  overlong_buffer: int | None = setting(
      None, cu.optional(cu.nonnegative_int),
      "DAPO overlong shaping: a linear penalty over the last L_cache response tokens (0: "
      'off; None: the preset\'s, max_new_tokens // 4 for "dapo", else off)', kind=int)

  def __post_init__(self):
    if self.selector is None:  # the command line's "none"
      object.__setattr__(self, "selector", "none")


ENV_TASKS = ("calculator", "guess", "math_tools")  # env.name (rl_jax.envs.tasks.TASKS)
# the adapters' task names and the env field that names each one's task
ENV_ADAPTERS = {"gymnasium": "gym_id", "verifiers": "verifiers"}
GYM_CODECS = ("auto", "frozen_lake", "blackjack", "default")  # env.gym_codec
TOOL_FORMATS = ("auto", "hermes", "llama3")  # env.tool_format (rl_jax.envs.tool_calls)


def _env_name(x: Any) -> str | None:
  """``env.name``: "", a built-in task, an adapter's name or an import path."""
  if x in ("",) + ENV_TASKS + tuple(ENV_ADAPTERS) or imports.is_import_path(x):
    return None
  return (f"must be '', a built-in task {ENV_TASKS}, one of {tuple(ENV_ADAPTERS)} or an "
          "import path module:factory (e.g. my_env:make)")


def _import_path_or_empty(x: Any) -> str | None:
  return None if x == "" or imports.is_import_path(x) else "must be an import path module:fn, or ''"


def _kv_ttl(x: Any) -> str | None:
  return (None if cu.is_int(x) and (x >= 0 or x == -1) else
          "must be decode steps >= 0, or -1 (never evict)")


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  """Multi-turn (agentic) training on an environment task (``rl_jax.envs.tasks``):
  ``config.env``; ``name=""`` is the single-turn trainer (``data``). With a name, the prompts
  are the task's opening messages, the rollouts are episodes of the multi-turn engine and R
  (the training row's response length) is ``max_total_tokens`` (``rl_jax.train.agent_stage``).
  The chat format is the compact built-in one with the char tokenizer, else the checkpoint's
  own template (``model.hf_path`` or ``data.tokenizer``). ``math_tools`` reads its questions
  from ``data.path`` (``data.format``, ``data.eval_path`` as for file tasks).

  Tasks from outside rl_jax: ``name="my_env:make"`` (an import path, ``rl_jax.imports``:
  ``make(env)`` returns an ``rl_jax.envs.EnvSpec``, where ``env`` is this section as a
  ``ConfigDict``, ``section()``; the user's own settings go in ``kwargs``),
  ``gym_id="FrozenLake-v1"`` (a gymnasium environment played in text; examples are episode
  seeds) or ``verifiers="my_tasks:load"`` (``load(env)`` returns a verifiers taskset, or a
  (train, eval) pair); the last two set ``name`` to "gymnasium" / "verifiers" when it is
  unset (``rl_jax.config.validate``)."""

  name: str = setting(
      "", _env_name,
      '"" | a built-in task (rl_jax.envs.tasks.TASKS: "calculator", "guess", "math_tools") | '
      '"module.path:factory" | "gymnasium" (gym_id) | "verifiers" (verifiers)')
  max_turns: int = setting(3, cu.positive_int, "U: assistant turns per trajectory")
  max_total_tokens: int = setting(
      48, cu.positive_int, "R: every token after the first prompt (model + observation)")
  max_turn_tokens: int = setting(16, cu.positive_int, "model tokens per assistant turn")
  max_obs_tokens: int = setting(
      16, cu.positive_int, "ids per observation (longer ones are cut and counted)")
  step_timeout_s: float = setting(
      10.0, cu.positive,
      "seconds an environment step may run (then an error observation; the time-out is "
      "recorded with the trajectory and replayed as recorded on resume)")
  result_delay_steps: int = setting(
      8, cu.positive_int,
      "a tool's result joins the decode batch this many decode steps after its call (the "
      "loop waits only for a later tool): every decode batch is a function of the seeds; "
      "size it to the tools' latency in decode steps")
  kv_ttl_steps: int = setting(
      -1, _kv_ttl,
      "decode steps a group waiting on its environments keeps its KV slot while other work "
      "waits for one (-1: always)")
  workers: int = setting(4, cu.positive_int, "environment threads")
  n_train: int = setting(2000, cu.positive_int, "examples of the task's train split")
  n_eval: int = setting(
      200, cu.positive_int,
      "calculator, gymnasium: held-out examples (guess: every target once)")
  digits_min: int = setting(2, cu.positive_int, "calculator: least digits of each factor")
  digits_max: int = setting(3, cu.positive_int, "calculator: most digits of each factor")
  guess_n: int = setting(20, cu.positive_int, "guess: targets in [1, guess_n]")
  step_penalty: float = setting(0.0, cu.nonnegative,
                                "guess: the reward of each wrong guess is -step_penalty")
  tool_format: str = setting(
      "auto", cu.one_of(TOOL_FORMATS),
      'math_tools: the tool-call format, "auto" = the one the chat template writes')
  system_prompt: str | None = setting(
      None, None,
      'math_tools: None = the task\'s, "" = none; gymnasium: the instructions before the '
      'first observation (None: the codec\'s, "" = none)', kind=str)
  python_timeout_s: float = setting(5.0, cu.positive,
                                    "math_tools: wall-clock seconds per Python call")
  max_tool_calls: int = setting(2, cu.positive_int,
                                "math_tools: tool calls run per assistant turn")
  enable_thinking: bool | None = setting(
      None, None, "HF chat templates: Qwen3's enable_thinking (None: the template's default)",
      kind=bool)
  kwargs: dict = setting(
      dict, None,
      "the user's own settings, read by an env.name=module:factory task and passed to "
      "gymnasium.make(gym_id, **kwargs); new keys may be set from the command line "
      "(--config.env.kwargs.is_slippery=False)")
  gym_id: str = setting("", _str("a gymnasium id"),
                        'gymnasium id (e.g. "FrozenLake-v1"); examples are episode seeds')
  gym_codec: str = setting(
      "auto", cu.one_of(GYM_CODECS),
      'gymnasium text codec: "auto" (FrozenLake, Blackjack by id, else "default"), '
      '"frozen_lake", "blackjack", "default" (an action\'s index for Discrete, Text as is)')
  invalid_reward: float = setting(
      0.0, lambda x: None if cu.is_number(x) and math.isfinite(x) else "must be a finite number",
      "gymnasium: the reward of a turn that is no valid action")
  verifiers: str = setting(
      "", _import_path_or_empty,
      '"module:fn", fn(env) -> a verifiers Taskset or (train, eval)')
  agent: str = setting(
      "", _import_path_or_empty,
      '"module:fn": every episode of the task (env.name\'s examples) is a session of the '
      "agent function fn(base_url, api_key, example) -> reward, which calls the policy "
      "through an OpenAI-compatible server on 127.0.0.1 (rl_jax.serve.sessions)")

  def __post_init__(self):
    if self.agent and not self.name:
      raise ConfigError(f"env.agent={self.agent!r} plays the episodes of a task: set env.name "
                        "(its examples, e.g. calculator or my_env:make)")
    if not self.name:
      return
    if self.digits_min > self.digits_max:
      raise ConfigError(f"env.digits_min={self.digits_min} exceeds env.digits_max="
                        f"{self.digits_max}")
    if self.max_turn_tokens > self.max_total_tokens:
      raise ConfigError(f"env.max_turn_tokens={self.max_turn_tokens} exceeds "
                        f"env.max_total_tokens={self.max_total_tokens}")

  def section(self) -> ml_collections.ConfigDict:
    """This section as a ``ConfigDict`` copy, locked against new keys: what a user's task
    factory (``name="module:factory"``) and verifiers loader receive (``env.kwargs.x`` and
    ``env.get("x")`` read as on the config; a change to it does not reach the run)."""
    c = ml_collections.ConfigDict(dataclasses.asdict(self))
    c.lock()
    return c


def _mesh_axes(shape: Any) -> str | None:
  """``mesh.shape``: one size per mesh axis (the sizes are checked against the devices when
  the mesh is built, ``rl_jax.train.context.mesh_shape``)."""
  if sorted(dict(shape)) != sorted(sharding.MESH_AXES):
    return f"must name the axes {list(sharding.MESH_AXES)}"
  if not all(cu.is_int(n) and (n >= 1 or n == -1) for n in dict(shape).values()):
    return "must give each axis an int >= 1, or -1 for the remaining devices"
  return None


@dataclasses.dataclass(frozen=True)
class MeshSettings:
  """The device mesh over (data, fsdp, sequence, tensor): ``config.mesh``
  (``rl_jax.sharding``)."""

  shape: dict = setting(lambda: {axis: -1 if axis == "fsdp" else 1
                                 for axis in sharding.MESH_AXES},
                        _mesh_axes, "each axis's size; -1 takes the remaining devices")
  rules: str = setting("fsdp", cu.one_of(sharding.RULES),
                       "how the weights are sharded: a key of rl_jax.sharding.RULES")
  num_devices: int = setting(0, cu.nonnegative_int, "use the first k devices (0: all)")
  rollout_devices: int = setting(
      0, cu.nonnegative_int,
      'train.mode="async": the first k devices form the rollout mesh and the training mesh '
      "(shape) takes the rest; 0: the producer samples on the training devices")
  sampler_tensor: int = setting(
      0, cu.nonnegative_int,
      "the sampler's own tensor-parallel size: its mesh splits heads, MLP and vocab over "
      "this many of its devices (rules fsdp_tp) while training keeps mesh.shape and "
      "mesh.rules; 0: the training mesh's tensor size and rules")


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
  """Multi-process start-up (``rl_jax.distributed``): ``config.distributed``. The three
  address fields together, or none (automatic on multi-host TPU slices and SLURM, else one
  process)."""

  coordinator_address: str | None = setting(None, None, '"host:port" of process 0', kind=str)
  num_processes: int | None = setting(None, None, "processes of the job", kind=int)
  process_id: int | None = setting(None, None, "this process's index", kind=int)
  initialization_timeout_s: int = setting(300, cu.positive_int,
                                          "how long to wait for every process to join")
  heartbeat_timeout_s: int = setting(100, cu.positive_int,
                                     "a process silent this long is dead: the job stops")


@dataclasses.dataclass(frozen=True)
class DryRunSettings:
  """``train.dry_run=True`` for a TPU topology this host does not have
  (``rl_jax.train.topology``, needs ``pip install -e ".[tpu]"``): every program of the run
  compiled for it with libtpu; HBM per chip, XLA's estimates; exit 0 if it fits:
  ``config.dry_run``."""

  topology: str = setting(
      "", _str("a TPU topology"),
      '"" plans on this job\'s devices (the memory plan); else a TPU slice named by its '
      'chips: "v5e:2x2" (4 chips), "v5p:2x2x2" (8 chips, sold as v5p-16), "v6e:2x4"')
  num_slices: int = setting(1, cu.positive_int,
                            "slices of that topology in the job (multislice)")
  max_batch: bool = setting(
      False, _BOOL,
      "also search the largest train.batch_groups whose RL phase fits the chip's HBM "
      "(rl_jax.train.topology.max_batch: one to four more compiles of the RL programs)")



def _lora_targets(x: Any) -> str | None:
  """``model.lora.targets``: distinct names of ``LORA_TARGETS``, comma-separated."""
  try:
    lora_lib.parse_targets(x)
  except (ValueError, AttributeError, TypeError):
    return (f"must be distinct names from {','.join(model_config_lib.LORA_TARGETS)}, "
            "comma-separated")
  return None


@dataclasses.dataclass(frozen=True)
class LoraSettings:
  """Low-rank adapters and the quantised base (``model.lora``; rl_jax.models.lora,
  rl_jax.models.quant, docs/LORA.md). With rank 0 (off) every other field keeps its default
  (``rl_jax.config.validate``)."""

  rank: int = setting(
      0, cu.nonnegative_int,
      "r > 0 trains only the adapters of the projections in targets; they add "
      "(alpha/r)·x·A·B, A random (init), B zero")
  alpha: float = setting(16.0, cu.positive, "the adapters' scale alpha")
  targets: str = setting("q,k,v,o,gate,up,down", _lora_targets,
                         "the adapted projections, comma-separated (q,k,v,o,gate,up,down)")
  init: str = setting("gaussian", cu.one_of(lora_lib.LORA_INITS),
                      "A's init: gaussian | kaiming (PEFT's)")
  quant: str = setting(
      "", cu.one_of(("", "int8", "int4")),
      "QLoRA: the frozen base's projections stored as int8 or int4 with float32 scales, "
      "one per quant_block entries along each weight's contraction axis, dequantised inside "
      'the matmul by the trainer, the sampler and the reference alike; "" keeps base_dtype')
  quant_block: int = setting(
      64, cu.positive_int,
      "entries per scale (must divide hidden_size, head_dim and intermediate_size)")
  base_dtype: str = setting(
      "", cu.one_of(("", *model_config_lib.DTYPES)),
      'storage dtype of the frozen base ("": model.dtype, the compute dtype: a base that is '
      "never updated needs no float32 master copy); the adapters are stored in "
      "model.param_dtype")
  adapter_path: str | None = setting(
      None, None,
      "a PEFT LoRA adapter directory (as hf_adapter/ exports) whose A and B replace the "
      "fresh adapters at the start of the run; its r, lora_alpha, target_modules and shapes "
      "must match rank, alpha, targets and the base, and its base_model_name_or_path (if "
      "set) must name hf_path. The KL reference stays the base with the adapters off",
      kind=str)


@dataclasses.dataclass(frozen=True)
class ModelSettings:
  """The policy model: ``config.model``. Either ``hf_path`` (an HF checkpoint directory whose
  config.json gives the architecture fields) or the architecture fields of a random init;
  ``build_setup`` turns them into ``rl_jax.models.ModelConfig``. The rules between the
  fields are ``rl_jax.config.validate``'s (they involve the checkpoint or other sections)."""

  hf_path: str | None = setting(
      None, None, "an HF checkpoint directory; if set, the architecture comes from its "
      "config.json", kind=str)
  architecture: str = setting("llama", cu.one_of(model_config_lib.ARCHITECTURES),
                              "one of rl_jax.models.config.ARCHITECTURES")
  vocab_size: int = setting(
      256, None, "kept for config files that set it; a random init takes the tokenizer's size")
  hidden_size: int = setting(64, None, "d_model")
  intermediate_size: int = setting(128, None, "the MLP's width")
  num_layers: int = setting(2, cu.positive_int, "L, decoder layers")
  num_heads: int = setting(4, None, "query heads")
  num_kv_heads: int = setting(2, None, "key/value heads (grouped-query attention)")
  head_dim: int = setting(16, None, "the width of a head")
  rope_theta: float = setting(10000.0, None, "the RoPE base")
  max_position_embeddings: int = setting(1024, None, "the longest sequence")
  tie_word_embeddings: bool = setting(False, None, "the LM head is the embedding")
  init_std: float = setting(0.02, None, "the random init's standard deviation (no hf_path)")
  dtype: str = setting("float32", cu.one_of(model_config_lib.DTYPES), "the compute dtype")
  param_dtype: str = setting(
      "float32", cu.one_of(model_config_lib.DTYPES),
      "storage dtype of the trained weights (with lora.rank: the adapters; the frozen base "
      "is in lora.base_dtype)")
  remat: str = setting("none", cu.one_of(model_config_lib.REMAT_POLICIES),
                       "one of rl_jax.models.config.REMAT_POLICIES")
  fused_mlp: bool | None = setting(
      None, cu.optional(_BOOL),
      "one gate/up matmul, hand-written SwiGLU backward (ModelConfig.fused_mlp); None: auto "
      "(on for CPU programs, off for TPU and GPU)", kind=bool)
  scan_layers: bool = setting(True, _BOOL, "False unrolls the layer loop: no scan, longer "
                              "compiles")
  prefix_attention: str = setting(
      "auto", cu.one_of(model_config_lib.PREFIX_ATTENTIONS),
      'packed-layout and decode response attention: "auto" ("concat" on CPU, "kernel" on '
      'TPU and GPU, by the mesh\'s platform), "kernel" (Pallas / its jnp reference; decode: '
      'the paged kernel) or "concat" (one softmax over [prompt | own] keys; faster on CPU)')
  num_experts: int = setting(
      0, cu.nonnegative_int,
      'E experts per MoE layer (architecture="qwen3_moe"; 0 for the other architectures)')
  num_experts_per_tok: int = setting(2, cu.positive_int, "X, the experts of a token")
  moe_intermediate_size: int = setting(0, cu.nonnegative_int,
                                       "an expert MLP's width (0: intermediate_size)")
  norm_topk_prob: bool = setting(True, None,
                                 "renormalise the X routing weights to sum to one")
  moe_every: int = setting(1, cu.positive_int,
                           "every moe_every-th layer is MoE (the others a dense MLP)")
  router: str = setting("softmax_topk", cu.one_of(moe.ROUTERS),
                        "one of rl_jax.models.moe.ROUTERS")
  router_replay: bool = setting(
      False, _BOOL, "the training passes use the experts the sampler chose for each token")
  moe_capacity_factor: float | None = setting(
      0.0, cu.optional(cu.nonnegative),
      "expert capacity of the training passes: 0 (or None) = dropless grouped matmuls; > 0 = "
      "each token shard sends at most C = ceil(factor · tokens · X / E) assignments to an "
      "expert (all-to-all expert parallelism on a mesh that shards the experts), the rest "
      "dropped (metric moe_dropped_tokens). The sampler is dropless", kind=float)
  router_aux_loss_coef: float = setting(
      0.0, cu.nonnegative,
      "> 0 adds coef × the load-balancing loss (Switch; rl_jax.models.moe."
      "load_balancing_loss) of the current router over the real tokens to the RL update and "
      "the supervised step, metric moe_aux_loss. A checkpoint's own router_aux_loss_coef is "
      "not applied: set this field to use it")
  attention: str = setting(
      "full", cu.one_of(model_config_lib.ATTENTION_LAYOUTS),
      '"full" everywhere, or (gemma3) "sliding": sliding-window layers of sliding_window keys '
      "with a global layer every global_every layers")
  sliding_window: int = setting(512, cu.positive_int, "keys of a sliding-window layer")
  global_every: int = setting(6, cu.positive_int, "a global layer every this many layers")
  lora: LoraSettings = setting(LoraSettings, None, "low-rank adapters, the quantised base")

  def __post_init__(self):
    if not self.hf_path:  # with a checkpoint its config.json decides (checked at setup)
      arch = self.architecture
      if (arch == "qwen3_moe") != (self.num_experts > 0):
        raise ConfigError(f"model.num_experts={self.num_experts}: architecture 'qwen3_moe' "
                          f"needs experts (> 0) and the other architectures none (got {arch!r})")
      if self.num_experts and self.num_experts_per_tok > self.num_experts:
        raise ConfigError(f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                          f"model.num_experts={self.num_experts}")
      if self.attention == "sliding" and arch != "gemma3":
        raise ConfigError(f"model.attention='sliding' needs model.architecture='gemma3' "
                          f"(got {arch!r})")
      self.check_moe_fields(arch)
    self._check_lora_off()

  def check_moe_fields(self, arch: str) -> None:
    """The mixture-of-experts switches against the model's architecture ``arch``:
    ``architecture`` for a random init, the checkpoint's ``model_type`` once the setup has
    read it."""
    if arch == "qwen3_moe":
      return
    for name in ("moe_capacity_factor", "router_replay", "router_aux_loss_coef"):
      value = getattr(self, name)
      if value:
        raise ConfigError(f"model.{name}={value} needs a mixture-of-experts model "
                          f"(architecture 'qwen3_moe'), got {arch!r}")

  def _check_lora_off(self) -> None:
    """``lora.rank=0`` means LoRA is off: any other ``lora`` field changed from its default
    would be silently ignored, so it is an error."""
    lo, default = self.lora, LoraSettings()
    if lo.rank:
      return
    for key in ("quant", "adapter_path", "targets", "alpha", "init", "quant_block",
                "base_dtype"):
      value, base = getattr(lo, key), getattr(default, key)
      same = (lora_lib.parse_targets(value) == lora_lib.parse_targets(base)
              if key == "targets" else value == base or (not value and not base))
      if not same:
        why = (" (a quantised base is frozen: only adapters can train on it)" if key == "quant"
               else "")
        raise ConfigError(f"model.lora.{key}={value!r} needs model.lora.rank > 0: "
                          f"model.lora.rank=0, so LoRA is off{why}")


SECTIONS = {"rollout": RolloutSettings, "train": TrainSettings, "sft": SftSettings,
            "eval": EvalSettings, "distill": DistillSettings, "log": LogSettings,
            "optim": OptimSettings, "loss_extra": LossExtraSettings, "reward": RewardSettings,
            "data": DataSettings, "env": EnvSettings, "mesh": MeshSettings,
            "distributed": DistributedSettings, "dry_run": DryRunSettings,
            "model": ModelSettings}
# the sections the setup holds, each as its field of the same name (``Setup.rollout``, ...);
# mesh and distributed are read while the setup is built (the devices, the processes)
SETUP_SECTIONS = tuple(name for name in SECTIONS if name not in ("mesh", "distributed"))


def _default(f: dataclasses.Field) -> Any:
  return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _is_settings(value: Any) -> bool:
  return dataclasses.is_dataclass(value) and not isinstance(value, type)


def section_config(cls) -> ml_collections.ConfigDict:
  """The ``ConfigDict`` of a settings class's defaults (a None default is a placeholder of
  the field's ``kind``, so the command line parses it, and any default with a ``kind`` a
  reference of that type, which None may replace; a nested settings class is a nested
  section)."""
  out = {}
  for f in dataclasses.fields(cls):
    value = _default(f)
    if _is_settings(value):
      out[f.name] = section_config(type(value))
    elif value is None:
      out[f.name] = config_dict.placeholder(f.metadata.get("kind"))
    elif f.metadata.get("kind") is not None:  # a default that may be set to None
      out[f.name] = config_dict.FieldReference(value, field_type=f.metadata["kind"])
    else:
      out[f.name] = value
  return ml_collections.ConfigDict(out)


def section_checks(section: str, cls) -> dict[str, Any]:
  """The value checks of a settings class, keyed ``section.field`` (``rl_jax.config``'s check
  table; nested sections ``section.sub.field``)."""
  out = {}
  for f in dataclasses.fields(cls):
    value = _default(f)
    if _is_settings(value):
      out.update(section_checks(f"{section}.{f.name}", type(value)))
    elif f.metadata.get("check") is not None:
      out[f"{section}.{f.name}"] = f.metadata["check"]
  return out


def _build(cls, section: str, values: dict):
  fields = {f.name: f for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - set(fields))
  if unknown:
    raise ConfigError(f"config.{section} has no field {unknown[0]!r} (fields: "
                      f"{', '.join(sorted(fields))})")
  kwargs = {}
  for name, f in fields.items():
    if name not in values:
      kwargs[name] = _default(f)
      continue
    value = values[name]
    default = _default(f)
    if _is_settings(default):
      value = _build(type(default), f"{section}.{name}", dict(value))
    kwargs[name] = value
  return cls(**kwargs)


def from_section(cls, section: str, values: ml_collections.ConfigDict):
  """The settings of one config section: every field's check (one ``ConfigError`` line
  naming ``section.field``), then the class's own rules. A key the class does not declare
  is a ``ConfigError`` too."""
  values = values.to_dict() if isinstance(values, ml_collections.ConfigDict) else dict(values)
  tree = values
  for name in reversed(section.split(".")):  # "train.replay": {"train": {"replay": ...}}
    tree = {name: tree}
  cu.validate(ml_collections.ConfigDict(tree), section_checks(section, cls))
  return _build(cls, section, values)
