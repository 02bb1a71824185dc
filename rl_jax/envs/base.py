"""Environment and tool interfaces for multi-turn (agentic) rollouts.

An episode is a conversation. ``Environment.reset(example, seed)`` returns the opening
messages (system/user); the model answers with one assistant turn, decoded to text and
passed to ``Environment.step(action)``, which returns the messages the environment adds
(tool results, game feedback), a per-turn reward and whether the episode is over.

Environments see text; the trainer keeps token ids. The rollout engine keeps the model's
sampled ids exactly as sampled and tokenizes only the environment's new messages, once
(``rl_jax.envs.chat``), so the trained ids are the sampled ids by construction.

Episodes must be deterministic given ``(example, seed)`` and the sequence of actions: a
resumed run rebuilds a held episode by calling ``reset`` and replaying its recorded actions.

State keys (GiGPO's anchor states, docs/ALGORITHMS.md): an environment may say which state
a turn starts from, so that turns of different trajectories that reach one state by
different paths share a step group. ``StepResult.state_key`` is the key of the state after
the step; an environment may also define ``state_key()``, the key of its current state, read
after ``reset`` (the first turn's state) and after every step whose result carries none. A
key is built of str, bytes, int, float, bool, None and tuples of them (hashed the same in
every process); a turn without one is keyed by its token history.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Hashable, Mapping, Protocol, Sequence, runtime_checkable

__all__ = ["Environment", "Message", "StepResult", "Tool", "opening_messages", "step_problem"]


@dataclasses.dataclass(frozen=True)
class Message:
  """One chat message.

  role: "system", "user", "assistant" or "tool". content: its text. name: the tool's name
  for a "tool" message (None otherwise).
  """

  role: str
  content: str
  name: str | None = None

  def as_dict(self) -> dict[str, Any]:
    """The message as the dict a Hugging Face chat template expects."""
    out: dict[str, Any] = {"role": self.role, "content": self.content}
    if self.name is not None:
      out["name"] = self.name
    return out


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What an environment returns for one assistant turn.

  messages: the messages the environment appends (empty when ``done``). reward: this turn's
  reward (summed into the trajectory's return; per-turn credit assignment reads it per
  turn). done: the episode is over. info: counters the trainer turns into metrics, e.g.
  ``{"tool_calls": 1, "tool_errors": {"timeout": 1}}``. state_key: the key of the
  environment's state after this step (module docstring), or None.
  """

  messages: tuple[Message, ...] = ()
  reward: float = 0.0
  done: bool = False
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  state_key: Hashable | None = None


@runtime_checkable
class Tool(Protocol):
  """A callable tool: a name, a JSON schema of its arguments, and a call returning text."""

  name: str
  description: str
  parameters: Mapping[str, Any]  # JSON schema of the arguments object

  def __call__(self, **arguments: Any) -> str:
    ...


@runtime_checkable
class Environment(Protocol):
  """A text environment for one episode (one instance per trajectory).

  ``tools`` lists the tools the chat template advertises (empty for games). It may also
  define ``state_key() -> Hashable | None``, the key of its current state (module docstring).
  """

  tools: Sequence[Tool]

  def reset(self, example: Mapping[str, Any], seed: int) -> Sequence[Message]:
    """Start an episode for a dataset example; returns the opening messages."""
    ...

  def step(self, action: str) -> StepResult:
    """Apply the model's decoded assistant turn; returns the environment's answer."""
    ...


def _messages_problem(messages: Any) -> str | None:
  """Why ``messages`` is not a sequence of ``Message``, or None."""
  if isinstance(messages, (str, bytes, Message)) or not hasattr(messages, "__iter__"):
    return f"a {type(messages).__name__}, not a list of Message"
  bad = [m for m in messages if not isinstance(m, Message)]
  return f"a list holding {type(bad[0]).__name__}, not Message" if bad else None


def opening_messages(env: Environment, example: Mapping[str, Any], seed: int) -> list[Message]:
  """``env.reset(example, seed)`` as a list; TypeError naming what ``reset`` returned when
  it is not a sequence of ``Message``."""
  messages = env.reset(example, seed)
  problem = _messages_problem(messages)
  if problem:
    raise TypeError(f"reset returned {problem}")
  return list(messages)


def step_problem(result: Any) -> str | None:
  """Why ``step``'s return cannot be used (not a ``StepResult``, a reward that is not a
  finite number, observations that are not ``Message``), or None."""
  if not isinstance(result, StepResult):
    return f"step returned a {type(result).__name__}, not a StepResult"
  try:
    reward = float(result.reward) if not isinstance(result.reward, (str, bytes)) else None
  except (TypeError, ValueError):
    reward = None
  if reward is None or not math.isfinite(reward):
    return f"step returned reward {result.reward!r}, not a finite number"
  problem = _messages_problem(result.messages)
  return f"step returned messages that are {problem}" if problem else None
