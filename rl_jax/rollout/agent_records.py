"""Host-side records of multi-turn rollouts: the renderer protocol, episode requests, the
per-trajectory record, the returned ``AgentRollout`` and environment seeding.

Axis letters: the legend of ``rl_jax/__init__.py`` (G groups, M samples per group,
B = G·M rows, R trajectory length = every token after the first prompt); local to the
multi-turn modules: U turns (the per-trajectory turn limit).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from rl_jax.envs.base import Environment, Message
from rl_jax.rollout.records import padded_routing

__all__ = ["AgentRollout", "EpisodeSpec", "Renderer", "Trajectory", "assemble_trajectories",
           "env_seed", "error_count", "error_kinds"]


@runtime_checkable
class Renderer(Protocol):
  """The chat format the engine needs (e.g. ``rl_jax.envs.chat``'s formats).

  prompt_ids(messages, tools=()): ids of the opening messages, ending with the header of
    the assistant's first turn (the generation prompt).
  delta_ids(history, new): ids to append after the assistant's sampled turn, which ends
    with its stop id (``end_of_turn_ids[0]``): ``history`` is the conversation so far,
    ending with the assistant's message; ``new`` the environment's messages. The ids end with
    the header of the assistant's next turn.
  end_of_turn_ids: ids that close an assistant turn. The model's turn ends when it samples
    ``end_of_turn_ids[0]`` (the default stop id); a turn cut by its token budget gets that id
    appended as an observation token, as if sampled, before ``delta_ids``.
  """

  end_of_turn_ids: Sequence[int]

  def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Any] = ()) -> list[int]:
    ...

  def delta_ids(self, history: Sequence[Message], new: Sequence[Message]) -> list[int]:
    ...


@dataclasses.dataclass
class EpisodeSpec:
  """One group's episode: ``make_env()`` builds a fresh environment per sample, reset on
  ``example`` with the sample's seed (``env_seed``). ``meta`` is returned with the group."""

  make_env: Callable[[], Environment]
  example: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  meta: Any = None


def env_seed(seed: int, uid: int, sample: int) -> int:
  """The environment seed of sample ``sample`` of group ``uid`` under base ``seed``: a
  31-bit integer that depends only on the three (not on slots, timing or the process)."""
  words = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, int(uid), int(sample)])
  return int(words.generate_state(1, np.uint32)[0] >> 1)


def error_kinds(value) -> dict[str, int]:
  """A tool-error counter from ``StepResult.info`` by kind (a bare int counts as "error")."""
  if isinstance(value, Mapping):
    return {str(k): int(v) for k, v in value.items() if int(v)}
  return {"error": int(value)} if int(value or 0) else {}


def error_count(value) -> int:
  """A tool-error counter from ``StepResult.info``: an int, or a dict of ints by kind."""
  if isinstance(value, Mapping):
    return int(sum(int(v) for v in value.values()))
  return int(value or 0)


@dataclasses.dataclass
class Trajectory:
  """One sample's episode as it runs; token lists are aligned index by index.

  ``tokens`` are the ids after the first prompt, exactly as sampled (model tokens) or
  appended (observation tokens: ``delta_ids``, and the stop id of a budget-cut turn).
  """

  env: Any
  messages: list[Message]
  tokens: list[int] = dataclasses.field(default_factory=list)
  logprobs: list[float] = dataclasses.field(default_factory=list)
  versions: list[int] = dataclasses.field(default_factory=list)
  model: list[bool] = dataclasses.field(default_factory=list)
  turn: list[int] = dataclasses.field(default_factory=list)
  actions: list[str] = dataclasses.field(default_factory=list)
  turn_rewards: list[float] = dataclasses.field(default_factory=list)
  # per applied environment step: it ran past the time-out (its observation is the error)
  turn_timeouts: list[bool] = dataclasses.field(default_factory=list)
  turn_ends: list[int] = dataclasses.field(default_factory=list)
  tool_calls: int = 0
  tool_errors: int = 0
  timeouts: int = 0
  env_errors: int = 0
  env_time: float = 0.0
  tool_latency: float = 0.0  # seconds inside tools (``info["tool_latency_s"]``)
  error_kinds: dict = dataclasses.field(default_factory=dict)  # tool-error kind -> count
  truncated_obs: bool = False  # an observation was cut to max_obs_tokens
  truncated_turn: bool = False  # a turn was cut by max_turn_tokens
  # "done", "max_turns" or "max_tokens"; a single-turn request's sample (no environment):
  # the sampler's reason, "eos", "stop" or "length"; None while running
  finish: str | None = None
  # mixture-of-experts models: int32 [len(tokens),Y,X] the experts of each token the sampler
  # fed (-1: not recorded: observation tokens, the last token), as ``records.Sample.routing``
  routing: np.ndarray | None = None

  def append(self, ids, logprobs, versions, model: bool, turn: int):
    """Append aligned ids, log-probs and versions (model or observation tokens)."""
    self.tokens += [int(t) for t in ids]
    self.logprobs += [float(x) for x in logprobs]
    self.versions += [int(v) for v in versions]
    self.model += [model] * len(ids)
    self.turn += [turn] * len(ids)

  def after(self, k: int) -> "Trajectory":
    """A copy without its first ``k`` ids (the prompt's ids that open a trajectory whose
    prompt is on pool pages: ``loop.Group.skip``); turn ends count from the new start."""
    if not k:
      return self
    return dataclasses.replace(
        self, tokens=self.tokens[k:], logprobs=self.logprobs[k:], versions=self.versions[k:],
        model=self.model[k:], turn=self.turn[k:], turn_ends=[e - k for e in self.turn_ends],
        routing=None if self.routing is None else self.routing[k:])


@dataclasses.dataclass
class AgentRollout:
  """Multi-turn trajectories, one row per sample, group-major (group 0's M samples first).

  Attributes (B = G·M rows, R = max_total_tokens, U = max_turns):
    tokens: int32 [B,R] every id after the first prompt (model and observation tokens,
      0 after the end). lengths: int32 [B].
    model_mask: bool [B,R] True on sampled (model) tokens only.
    logprobs: float32 [B,R] behaviour log-prob of model tokens (0 elsewhere).
    versions: int32 [B,R] policy version that sampled each model token (-1 elsewhere).
    turn: int32 [B,R] turn of each token (an observation carries the index of the turn it
      answers; -1 on padding).
    turn_rewards: float32 [B,U] (0 past the last turn). turn_ends: int32 [B,U] index one
      past each turn's last model token (-1 past the last turn). num_turns: int32 [B].
    reward: float32 [B] sum of the turn rewards.
    tool_calls, tool_errors, timeouts, env_errors: int32 [B] counts (``StepResult.info``;
      timeouts and environment exceptions became error observations).
    env_time: float32 [B] seconds spent in environment steps.
    truncated_obs, truncated_turn: bool [B] an observation / a turn was cut to its limit.
    finish_reason: str [B] "done" (the environment ended it), "max_turns" or "max_tokens".
    actions: per row, the decoded assistant turns (rebuild an episode: reset + replay).
    tool_latency: float32 [B] seconds inside tools. error_kinds: per row, tool errors by
      kind (``StepResult.info["tool_errors"]`` as a dict).
    prompts: the G first prompts (id lists). prompt_index: int32 [B]. group_ids: int [G].
    group_meta: each group's ``EpisodeSpec.meta``. stats: dict of scalars.
    routing: mixture-of-experts models: int32 [B,R,Y,X] the experts each MoE layer chose for
      each model token when the sampler fed it (-1 on observation tokens, a trajectory's
      last token and padding: router replay routes those by the router); None for dense
      models.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  model_mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  turn: np.ndarray
  turn_rewards: np.ndarray
  turn_ends: np.ndarray
  num_turns: np.ndarray
  reward: np.ndarray
  tool_calls: np.ndarray
  tool_errors: np.ndarray
  timeouts: np.ndarray
  env_errors: np.ndarray
  env_time: np.ndarray
  truncated_obs: np.ndarray
  truncated_turn: np.ndarray
  finish_reason: np.ndarray
  actions: list[list[str]]
  prompts: list[list[int]]
  prompt_index: np.ndarray
  group_ids: np.ndarray
  group_meta: list
  stats: dict[str, float]
  tool_latency: np.ndarray | None = None
  error_kinds: list | None = None
  routing: np.ndarray | None = None


def assemble_trajectories(groups: Sequence[tuple[int, list[int], list[Trajectory], Any]],
                          R: int, U: int) -> AgentRollout:
  """Stack finished groups ``(uid, prompt, trajectories, meta)`` into an AgentRollout."""
  rows = [(g, t) for g, (_, _, trajs, _) in enumerate(groups) for t in trajs]
  B = len(rows)
  out = dict(tokens=np.zeros((B, R), np.int32), lengths=np.zeros(B, np.int32),
             model_mask=np.zeros((B, R), bool), logprobs=np.zeros((B, R), np.float32),
             versions=np.full((B, R), -1, np.int32), turn=np.full((B, R), -1, np.int32),
             turn_rewards=np.zeros((B, U), np.float32), turn_ends=np.full((B, U), -1, np.int32),
             num_turns=np.zeros(B, np.int32), reward=np.zeros(B, np.float32),
             tool_calls=np.zeros(B, np.int32), tool_errors=np.zeros(B, np.int32),
             timeouts=np.zeros(B, np.int32), env_errors=np.zeros(B, np.int32),
             env_time=np.zeros(B, np.float32), tool_latency=np.zeros(B, np.float32),
             truncated_obs=np.zeros(B, bool),
             truncated_turn=np.zeros(B, bool))
  reasons = []
  for b, (_, t) in enumerate(rows):
    n, u = len(t.tokens), len(t.turn_rewards)
    out["tokens"][b, :n], out["lengths"][b] = t.tokens, n
    out["model_mask"][b, :n], out["turn"][b, :n] = t.model, t.turn
    out["logprobs"][b, :n] = np.where(t.model, t.logprobs, 0.0)
    out["versions"][b, :n] = np.where(t.model, t.versions, -1)
    out["turn_rewards"][b, :u], out["turn_ends"][b, :u] = t.turn_rewards, t.turn_ends
    out["num_turns"][b], out["reward"][b] = u, sum(t.turn_rewards)
    for name in ("tool_calls", "tool_errors", "timeouts", "env_errors", "env_time",
                 "tool_latency", "truncated_obs", "truncated_turn"):
      out[name][b] = getattr(t, name)
    reasons.append(t.finish)
  return AgentRollout(
      **out, finish_reason=np.asarray(reasons, dtype=str).reshape(B),
      actions=[list(t.actions) for _, t in rows],
      error_kinds=[dict(t.error_kinds) for _, t in rows], prompts=[list(g[1]) for g in groups],
      prompt_index=np.asarray([g for g, _ in rows], np.int32),
      group_ids=np.asarray([g[0] for g in groups], np.int64),
      group_meta=[g[3] for g in groups], routing=padded_routing([t for _, t in rows], R),
      stats={"trajectories": B, "groups": len(groups),
             "model_tokens": int(out["model_mask"].sum()),
             "observation_tokens": int(out["lengths"].sum() - out["model_mask"].sum())})
