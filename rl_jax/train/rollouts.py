"""What producer and learner share: the ``TrainParts`` record and the host-side helpers of a
step (prompt encoding and padding, the seeded prompt sampler, decoding, scoring, sampling on
the sampler's mesh). ``Scored`` is re-exported from ``records``.

Shapes (the package legend, ``rl_jax/__init__.py``): G groups, M samples per prompt,
P prompt bucket, R new tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from rl_jax import rollout
from rl_jax.data import group_rewards
from rl_jax.data import rewards as rewards_lib
from rl_jax.data import selection
from rl_jax.data import tokenizers
from rl_jax.train import judge_stage
from rl_jax.train.context import Setup
from rl_jax.train.layout import Layout
from rl_jax.train.records import ProducerState, Scored
from rl_jax.train.steps import StepFns

__all__ = ["TrainParts", "Sampled", "Scored", "next_indices", "next_examples", "encode_prompts",
           "pad_prompts", "decode", "score", "score_groups", "generate"]


class TrainParts(NamedTuple):
  """The parts of a training run that stay fixed while its state changes (``make_trainer``
  builds them; ``rl_jax.api.Trainer`` wraps them with a state for hand-written loops): its
  static setup, its layout on the mesh, its compiled steps, (for ``rollout.partial``) its
  engine and (for ``env.name``) its multi-turn engines (``agent_stage.make_engines``:
  training, greedy evaluation)."""

  setup: Setup
  layout: Layout
  steps: StepFns
  engine: rollout.RolloutEngine | None
  agent: tuple | None = None
  teacher: Any = None  # distill.teacher_path: the teacher's params (train.teacher)


class Sampled(NamedTuple):
  """One step's sampled groups on the host.

  examples: G ``Example``s; prompts: G token lists; tokens / mask / logprobs [G·M,R]
  (behaviour log-probs); versions int32 [G·M,R] policy version of each token;
  stats: the engine's counters; producer: the producer's position after them;
  routing: MoE models: int32 [G·M,R,Y,X] the sampler's expert records, else None.
  """

  examples: list
  prompts: list[list[int]]
  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray | None
  stats: dict
  producer: ProducerState
  routing: np.ndarray | None = None


# ---------------------------------------------------------------------- host-side helpers
def encode_prompts(s: Setup, examples) -> list[list[int]]:
  """Each example's prompt ids (after a bos where the tokenizer prepends one,
  ``tokenizers.encode_prompt``)."""
  return [tokenizers.encode_prompt(s.tokenizer, e.prompt) for e in examples]


def pad_prompts(prompts: Sequence[Sequence[int]], P: int,
                pad: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded int32 [G,P] prompt tokens and int32 [G] lengths."""
  out = np.full((len(prompts), P), pad, np.int32)
  for i, p in enumerate(prompts):
    out[i, :len(p)] = p
  return out, np.asarray([len(p) for p in prompts], np.int32)


def decode(s: Setup, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
  """The text of each row's valid tokens."""
  return [s.tokenizer.decode([int(t) for t, m in zip(row, mrow) if m])
          for row, mrow in zip(tokens, mask)]


def score(s: Setup, completions: list[str], answers: list[str]) -> tuple[np.ndarray, dict]:
  """The task's verifier on each completion (isolated, time-limited): rewards (a verifier's
  named components summed), counters. Evaluation scores with it; training with
  ``score_groups``."""
  return rewards_lib.compute_rewards(s.task.verify, completions, answers,
                                     timeout_s=s.data.reward_timeout_s)


def score_groups(s: Setup, completions: list[str], examples: Sequence,
                 M: int) -> tuple[np.ndarray, np.ndarray | None, dict]:
  """Training rewards of ``len(examples)`` groups of M completions ([G·M], group-major): the
  group function once per group (``reward.group_fn``), else the judge model's verdict per row
  on its example's prompt, completion and answer (``reward.judge_path``, ``judge_stage``; a
  row without a verdict scores 0 and is counted), else the task's verifier per row
  against each example's answer; (rewards float32 [G·M], components float32 [G·M,C] in the
  order of ``Setup.reward_names`` or None, counters). C counts the verifier's components
  only (the overlong one is added by the caller)."""
  names = tuple(n for n in s.reward_names if n != "overlong")
  if s.group_fn is not None:
    who = f"reward.group_fn={s.reward.group_fn!r}"
    values, faults = group_rewards.score_groups(s.group_fn, completions, examples, M, who,
                                                timeout_s=s.data.reward_timeout_s)
  elif s.judge is not None:
    who = f"reward.judge_path={s.reward.judge_path}"
    rows = [e for e in examples for _ in range(M)]
    values, faults = judge_stage.as_values(s.judge.verdicts(
        [e.prompt for e in rows], completions, [e.answer for e in rows]),
        why=judge_stage.NO_VERDICT[s.reward.judge_verdict])
  else:
    who = "the task's verifier"
    values, faults = rewards_lib.verify_rows(s.task.verify, completions,
                                             [e.answer for e in examples for _ in range(M)],
                                             timeout_s=s.data.reward_timeout_s)
  rewards_lib.note_failures(who, faults.get("errors", ()))
  rewards, components = rewards_lib.stack_components(values, names, who)
  return rewards, components, faults


def next_indices(s: Setup, data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
  """The next ``n`` dataset indices of the seeded sampler at position ``data`` (epoch,
  position), and the position after them."""
  state = selection.SamplerState(int(s.data.seed), int(data[0]), int(data[1]))
  idx, state = selection.sampler_next(state, len(s.train_examples), n)
  return idx, np.asarray([state.epoch, state.position], np.int32)


def next_examples(s: Setup, data: np.ndarray, n: int) -> tuple[list, np.ndarray]:
  """The next ``n`` training examples of the seeded sampler, and the position after them."""
  idx, data = next_indices(s, data, n)
  return [s.train_examples[i] for i in idx], data


def generate(s: Setup, params, prompts, cfg=None, **kw):
  """``rollout.generate`` on the sampler's mesh with the task's EOS and length budget;
  ``params`` as ``Layout.sampler_params`` places them; the paged cache as configured;
  ``cfg``: the model config they are decoded with (default ``Setup.sampler_cfg``)."""
  r = s.rollout
  return rollout.generate(cfg or s.sampler_cfg, params, prompts, max_new_tokens=r.max_new_tokens,
                          eos_id=s.eos_id, mesh=s.sampler_mesh, rules=s.sampler_rules,
                          page_size=r.page_size, kv_pages=r.kv_pages,
                          kv_memory_fraction=r.kv_memory_fraction,
                          prefill_chunk=r.prefill_chunk, prompt_pages=r.prompt_pages, **kw)
