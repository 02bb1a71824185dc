"""Task specs: how to make one environment per trajectory, the example splits, and an expert.

Design: an environment instance holds one episode's state, so the rollout engine builds a
fresh one for every trajectory with ``spec.make_env(example)`` and starts it with
``env.reset(example, seed)``. An ``EnvSpec`` bundles that factory with the task's
deterministic train/eval examples and, for the built-in tasks, an expert policy whose
trajectories (``spec.expert(example, seed) -> list[Message]``) feed a supervised warm start.

``run_episode`` plays a policy (messages -> assistant text) against an environment; the
experts and the tests use it, and it documents the episode protocol in a few lines.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from rl_jax.envs.base import Environment, Message, StepResult, opening_messages

__all__ = ["EnvSpec", "Episode", "Policy", "run_episode"]

Policy = Callable[[Sequence[Message]], str]


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """A task: an environment factory, example splits and (optionally) an expert.

  Attributes:
    name: the task's name.
    make_env: ``example -> Environment``, a fresh instance per trajectory (not yet reset).
    train: training examples (dicts), deterministic given the task's seed.
    eval: evaluation examples, disjoint from ``train`` where the task's space allows.
    expert: ``(example, seed) -> list[Message]``, a full correct trajectory, or None.
    chat: the chat format the task is meant for: "builtin" (the char-level tasks; any
      format works) or "model" (a checkpoint's own chat template, which advertises the tools).
    play: ``example -> Environment`` for the episodes the engine plays (training and
      evaluation) when they differ from ``make_env``, which still gives the prompts and the
      expert's trajectories (an agent's sessions: ``env.agent``); None: ``make_env``.
    stats: ``() -> {name: number}``, counters of the task's episodes since the last call
      (added to each training step's metrics), or None.
  """

  name: str
  make_env: Callable[[Mapping[str, Any]], Environment]
  train: Sequence[Mapping[str, Any]] = ()
  eval: Sequence[Mapping[str, Any]] = ()
  expert: Callable[[Mapping[str, Any], int], list[Message]] | None = None
  chat: str = "builtin"
  play: Callable[[Mapping[str, Any]], Environment] | None = None
  stats: Callable[[], Mapping[str, float]] | None = None

  def start(self, example: Mapping[str, Any], seed: int = 0
            ) -> tuple[Environment, list[Message]]:
    """A fresh environment for ``example`` and its opening messages."""
    env = self.make_env(example)
    return env, opening_messages(env, example, seed)


@dataclasses.dataclass(frozen=True)
class Episode:
  """A played episode: all messages (opening, assistant, environment), per-turn results."""

  messages: list[Message]
  steps: list[StepResult]

  @property
  def total_reward(self) -> float:
    return float(sum(s.reward for s in self.steps))

  @property
  def done(self) -> bool:
    return bool(self.steps) and self.steps[-1].done


def run_episode(env: Environment, example: Mapping[str, Any], policy: Policy, seed: int = 0,
                max_turns: int = 32) -> Episode:
  """Play ``policy`` against ``env`` until done or ``max_turns`` assistant turns."""
  messages = opening_messages(env, example, seed)
  steps = []
  for _ in range(max_turns):
    action = policy(messages)
    messages.append(Message("assistant", action))
    result = env.step(action)
    steps.append(result)
    messages += list(result.messages)
    if result.done:
      break
  return Episode(messages, steps)
