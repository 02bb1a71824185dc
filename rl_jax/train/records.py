"""The typed hand-offs of a step: ``Scored`` (producer -> learner, and the runner's queue)
and ``ProducerState`` (what the producer carries from one batch to the next).

Shapes (the package legend, ``rl_jax/__init__.py``): G row groups (g: this process's),
M samples per group, P prompt bucket (``Setup.prompt_len``), R new tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from rl_jax.rollout import engine
from rl_jax.train import group_size, selection_stage

__all__ = ["ENGINE_STATS", "STATS", "Scored", "ProducerState", "array_fields"]

# The rollout engine's counters of a batch (defined with the engine)
ENGINE_STATS = engine.ENGINE_STATS
# ``Scored.stats`` keys the learner copies into the step's metrics (and the queue keeps)
STATS = ENGINE_STATS + selection_stage.METRICS + group_size.METRICS


class Scored(NamedTuple):
  """One step's groups, sampled and scored, on the host: what the rollout producer hands the
  learner (and what an asynchronous run keeps in its checkpointed queue).

  indices int32 [g]: dataset index of each group's prompt; prompts int32 [g,P]: those
  prompts' ids as sampled (``rollouts.encode_prompts``), right-padded with the tokenizer's
  pad id (``rollouts.pad_prompts``), and prompt_lens int32 [g] their lengths (the learner
  reads them and never tokenizes a prompt again); tokens / mask / logprobs [g·M,R]: sampled
  tokens, validity and behaviour log-probs; versions int32 [g·M,R]: the policy version
  (completed steps) that sampled each token; rewards float32 [g,M]; faults int64 [2]:
  verifier exceptions and timeouts; rollout_s: sampling wall time; version: the policy
  version the producer held; stats: counters (``STATS``); groups int32 [g]: with adaptive
  group size, the step's prompt of each row group (chunk), else None.
  turns: multi-turn batches (``env.name``): the per-turn inputs of ``agent_stage.turn_fields``
  (turn_rewards [g·M,U], turn_ids [g·M,R], turn_states [g·M,U]), else None; their
  ``tokens`` are the trajectories (model and observation ids) and ``mask`` the model tokens.
  routing: mixture-of-experts models: int32 [g·M,R,Y,X] the experts the sampler chose for
  each response token (``rollout.Rollout.routing``, multi-turn ``AgentRollout.routing``: -1
  on observation tokens; -1 where none was recorded), else None.
  components: float32 [g,M,C] the named reward components of each row (``Setup.reward_names``;
  ``rewards`` is their sum), else None.
  g is G with one process, this process's groups with several.
  """

  indices: np.ndarray
  prompts: np.ndarray
  prompt_lens: np.ndarray
  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  rewards: np.ndarray
  faults: np.ndarray
  rollout_s: float
  version: int
  stats: dict
  groups: np.ndarray | None = None
  turns: dict | None = None
  routing: np.ndarray | None = None
  components: np.ndarray | None = None


def array_fields() -> tuple[str, ...]:
  """The fields of ``Scored`` that are always arrays (read from its annotations)."""
  name = lambda v: v if isinstance(v, str) else getattr(v, "__forward_arg__", v)
  return tuple(k for k, v in Scored.__annotations__.items()
               if v is np.ndarray or name(v) == "np.ndarray")


class ProducerState(NamedTuple):
  """Where the rollout producer stands: what it hands on with each batch and reads back at
  the next one (checkpointed as ``TrainState.producer``).

  data: int32 [2] (epoch, position) of the prompt sampler (the supervised stage advances it
  too). held: with ``rollout.partial``, the rollout engine's held groups (partial and extra
  complete ones) as fixed-shape arrays (``RolloutEngine.export_held``); ``{}`` otherwise.
  selector: per-prompt state of the prompt selector (``selection_stage.selector_state``:
  GRESO streaks, Beta posteriors); ``{}`` for selectors without state. drafts: with
  ``rollout.speculative``, each prompt's last responses and their sampling distributions
  (``speculative_stage.drafts_state``); ``{}`` otherwise. replay: with ``train.replay``,
  the experience-replay ring of scored groups (``replay_stage.empty_buffer``); ``{}``
  otherwise.
  """

  data: Any
  held: Any = {}
  selector: Any = {}
  drafts: Any = {}
  replay: Any = {}
