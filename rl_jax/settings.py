"""Typed settings: config sections as frozen, self-checking dataclasses.

The ``ml_collections.ConfigDict`` of ``rl_jax.config`` stays the surface of config files and
the command line. A section with settings here has one home: each field's default, its
value check and its doc are declared on the field, ``rl_jax.config`` builds the section's
``ConfigDict`` (``section_config``) and its check table (``section_checks``) from them, and
the rules between fields of the section are the dataclass's ``__post_init__``. The setup
turns the section into its settings once (``from_section``: ``Setup.rollout``); the code
below the setup reads those, never the raw config, so a function's signature says what it
depends on.

* ``RolloutSettings``: ``config.rollout``, sampling for training rollouts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections
from ml_collections import config_dict

from rl_jax import config_checks as cu
from rl_jax.errors import ConfigError
from rl_jax.models import config as model_config_lib

__all__ = ["RolloutSettings", "from_section", "section_checks", "section_config", "setting"]


def setting(default: Any, check: Any = None, doc: str = "", *, kind: type | None = None):
  """A settings field: ``default``, ``check`` (an ``rl_jax.config_checks`` check, or a tuple
  of them, run on the value before the settings are built), ``doc`` (its meaning); ``kind``:
  the type of a field whose default is None (how the command line parses it)."""
  return dataclasses.field(default=default,
                           metadata={"check": check, "doc": doc, "kind": kind})


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
      False, cu.one_of((False, True)),
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
  max_staleness: int = setting(1, cu.in_range(-1, None),
                               "η: no token more than η policy versions old; -1 = unbounded")
  mask_stale: bool = setting(False, cu.one_of((False, True)),
                             "drop tokens sampled by an older policy from the loss")
  speculative: bool = setting(
      False, cu.one_of((False, True)),
      "SPEC-RL: the previous response of the same prompt is a draft, verified by the "
      "current policy (exact speculative sampling; docs/SELECTION.md)")
  spec_lenience: float = setting(0.0, cu.nonnegative,
                                 "l: accept with min(1, e^l p_new/p_old); 0 is exact")
  lora_merge: bool = setting(
      True, cu.one_of((False, True)),
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
  page_size: int = setting(
      64, cu.power_of_two,
      "The paged response cache (rl_jax/rollout/pages.py): tokens per page, a power of two "
      "(>= max_new_tokens: one worst-case page per sample, the unpaged layout)")
  kv_pages: int | None = setting(
      None, cu.optional(cu.positive_int),
      "Pool pages, fixed: when they run out the newest group is preempted and resumed by "
      "recompute (the same tokens; multi-turn runs too, partial turns kept). At least one "
      "group's whole budget. None: from rollout.kv_memory_fraction where the device "
      "reports its memory, else the pool grows as the responses need it (never preempts)",
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
      "(rl_jax/rollout/prefill.py); equal to float rounding")

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


def section_config(cls) -> ml_collections.ConfigDict:
  """The ``ConfigDict`` of a settings class's defaults (a None default is a placeholder of
  the field's ``kind``, so the command line parses it)."""
  out = {}
  for f in dataclasses.fields(cls):
    kind = f.metadata.get("kind")
    out[f.name] = config_dict.placeholder(kind) if f.default is None else f.default
  return ml_collections.ConfigDict(out)


def section_checks(section: str, cls) -> dict[str, Any]:
  """The value checks of a settings class, keyed ``section.field`` (``rl_jax.config``'s check
  table)."""
  return {f"{section}.{f.name}": f.metadata["check"] for f in dataclasses.fields(cls)
          if f.metadata.get("check") is not None}


def from_section(cls, section: str, values: ml_collections.ConfigDict):
  """The settings of one config section: every field's check (one ``ConfigError`` line
  naming ``section.field``), then the class's own rules. A key the class does not declare
  is a ``ConfigError`` too."""
  values = dict(values)
  known = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - known)
  if unknown:
    raise ConfigError(f"config.{section} has no field {unknown[0]!r} (fields: "
                      f"{', '.join(sorted(known))})")
  config = ml_collections.ConfigDict({section: values})
  cu.validate(config, section_checks(section, cls))
  return cls(**values)
