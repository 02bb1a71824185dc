"""Adapters from other environment libraries to ``rl_jax.envs.base.Environment``.

* ``GymnasiumTextEnv``: a ``gymnasium.Env`` played in text. A ``TextCodec`` turns
  observations into user messages and assistant text into actions (codecs are included for
  the toy-text FrozenLake and Blackjack; spaces of type ``gymnasium.spaces.Text`` pass text
  through). Rewards are gymnasium's per-step rewards. The state key of a turn
  (``state_key()``, GiGPO's step groups) is the observation's text.
* ``VerifiersEnvironment``: a ``verifiers`` (v1) ``Task`` -- its prompt opens the episode, the
  model may call rl_jax tools (``ToolEnvironment`` semantics), and the final answer is scored
  by the task's own ``@vf.reward`` functions (``Task.score``) on a ``Trace`` built from the
  conversation. ``verifiers_spec(taskset)`` makes an ``EnvSpec`` from a ``Taskset``. Only
  scoring that needs no runtime (container, sandbox) or judge model is usable offline.

Both libraries are optional and imported lazily.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any, Callable, Mapping, Sequence

from rl_jax.envs.base import Message, StepResult, Tool
from rl_jax.envs.spec import EnvSpec
from rl_jax.envs.tool_env import ToolEnvironment

__all__ = ["BLACKJACK_CODEC", "FROZEN_LAKE_CODEC", "GymnasiumTextEnv", "TextCodec",
           "VerifiersEnvironment", "discrete_codec", "verifiers_spec"]


@dataclasses.dataclass(frozen=True)
class TextCodec:
  """Observation -> text and text -> action (None for text that is no valid action)."""

  obs_to_text: Callable[[Any], str] = str
  text_to_action: Callable[[str], Any] | None = None
  instructions: str = ""


def discrete_codec(action_names: Sequence[str], obs_to_text: Callable[[Any], str] = str,
                   instructions: str = "") -> TextCodec:
  """A codec for a ``Discrete(len(action_names))`` action space: the model writes an action's
  name (case-insensitive) or its index."""
  names = [a.lower() for a in action_names]

  def to_action(text: str) -> int | None:
    word = text.strip().lower()
    if word in names:
      return names.index(word)
    return int(word) if word.isdigit() and int(word) < len(names) else None

  return TextCodec(obs_to_text, to_action, instructions)


FROZEN_LAKE_CODEC = discrete_codec(
    ("left", "down", "right", "up"), lambda s: f"at {int(s)}",
    "Reach the goal on the frozen lake. Moves: left, down, right, up.")
BLACKJACK_CODEC = discrete_codec(
    ("stick", "hit"),
    lambda o: f"sum {o[0]} dealer {o[1]}" + (" ace" if o[2] else ""),
    "Blackjack. Answer hit or stick.")


def _default_codec(env: Any) -> TextCodec:
  from gymnasium import spaces  # pylint: disable=import-outside-toplevel
  space = env.action_space
  if isinstance(space, spaces.Text):
    return TextCodec(str, lambda t: t if space.contains(t) else None)
  if isinstance(space, spaces.Discrete):
    return discrete_codec([str(space.start + i) for i in range(space.n)])
  raise ValueError(f"no default text codec for action space {space}; pass a TextCodec")


class GymnasiumTextEnv:
  """A gymnasium environment played in text (module docstring).

  Args:
    env: a ``gymnasium.Env`` or a zero-argument factory (called once).
    codec: the text codec (default: text pass-through for ``Text`` spaces, action index for
      ``Discrete``).
    max_turns: assistant turns before the episode is cut off (None: gymnasium decides).
    invalid_reward: reward for text that is no valid action (the environment does not step;
      the model is told "invalid action" and the turn counts).
    sample_seeds: reset with ``example["seed"] + seed`` (each sample its own episode); False:
      with ``example["seed"]`` alone, so every sample of an example plays the same episode
      (the same first observation and random stream: a group compares actions, and
      environments whose first observation is random, e.g. Blackjack, share one prompt).
  """

  tools: tuple = ()

  def __init__(self, env: Any, codec: TextCodec | None = None, max_turns: int | None = None,
               invalid_reward: float = 0.0, sample_seeds: bool = True):
    self.env = env() if callable(env) and not hasattr(env, "step") else env
    self.codec = codec or _default_codec(self.env)
    if self.codec.text_to_action is None:
      self.codec = dataclasses.replace(self.codec,
                                       text_to_action=_default_codec(self.env).text_to_action)
    self.max_turns, self.invalid_reward = max_turns, invalid_reward
    self.sample_seeds = bool(sample_seeds)
    self._turns = 0
    self._obs_text: str | None = None

  def state_key(self) -> str | None:
    """The current observation's text (None before ``reset``)."""
    return self._obs_text

  def reset(self, example: Mapping[str, Any], seed: int) -> list[Message]:
    base = int(example.get("seed", 0))
    obs, _ = self.env.reset(seed=base + seed if self.sample_seeds else base)
    self._turns = 0
    text = self._obs_text = self.codec.obs_to_text(obs)
    intro = example.get("instructions", self.codec.instructions)
    return [Message("user", f"{intro}\n{text}" if intro else text)]

  def step(self, action: str) -> StepResult:
    self._turns += 1
    out_of_turns = self.max_turns is not None and self._turns >= self.max_turns
    act = self.codec.text_to_action(action)
    if act is None or not self.env.action_space.contains(act):
      info = {"invalid_action": True, "truncated": out_of_turns}
      msgs = () if out_of_turns else (Message("user", "invalid action"),)
      return StepResult(msgs, self.invalid_reward, out_of_turns, info)
    obs, reward, terminated, truncated, _ = self.env.step(act)
    self._obs_text = self.codec.obs_to_text(obs)
    done = bool(terminated or truncated or out_of_turns)
    msgs = () if done else (Message("user", self._obs_text),)
    info = {"terminated": bool(terminated), "truncated": bool(truncated or
                                                               (out_of_turns and not terminated))}
    return StepResult(msgs, float(reward), done, info)


# -- verifiers --

def _run_sync(coro: Any) -> Any:
  """Run a coroutine to completion from sync code (in a thread if a loop is running)."""
  try:
    asyncio.get_running_loop()
  except RuntimeError:
    return asyncio.run(coro)
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return pool.submit(asyncio.run, coro).result()


def _opening_messages(task: Any) -> list[Message]:
  from verifiers.v1.types import content_text  # pylint: disable=import-outside-toplevel
  data = task.data
  out = [Message("system", data.system_prompt)] if data.system_prompt else []
  if isinstance(data.prompt, str):
    out.append(Message("user", data.prompt))
  else:
    out += [Message(m.role, content_text(m.content) or "") for m in data.prompt or []]
  return out


def _trace(task: Any, messages: Sequence[Message]) -> Any:
  """A verifiers ``Trace`` holding the conversation as a single branch."""
  import verifiers.v1 as vf  # pylint: disable=import-outside-toplevel
  from verifiers.v1 import types as vt  # pylint: disable=import-outside-toplevel
  from verifiers.v1.state import state_cls  # pylint: disable=import-outside-toplevel
  trace = vf.Trace(
      task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
      state=state_cls(type(task))(),
      agent=vf.AgentInfo(config=vf.AgentConfig(), name="rl_jax", trainable=False))
  for i, m in enumerate(messages):
    if m.role == "tool":
      msg = vt.ToolMessage(tool_call_id=f"call_{i}", content=m.content, name=m.name)
    else:
      msg = {"system": vt.SystemMessage, "user": vt.UserMessage,
             "assistant": vt.AssistantMessage}[m.role](content=m.content)
    trace.nodes.append(vf.MessageNode(parent=i - 1 if i else None, message=msg,
                                      sampled=m.role == "assistant"))
  trace.is_completed = trace.ok = True
  return trace


class VerifiersEnvironment:
  """A ``verifiers`` v1 ``Task`` as an rl_jax environment (module docstring).

  ``reset(example, seed)`` reads the task from ``example["task"]``. After the episode,
  ``rewards`` holds the task's named reward values.

  Args:
    tools: rl_jax tools the model may call before answering.
    parser: tool-call format (``ToolEnvironment``).
    max_turns: assistant turns before the episode is cut off.
    max_tool_calls_per_turn: see ``ToolEnvironment``.
  """

  def __init__(self, tools: Sequence[Tool] = (), parser: str = "hermes", max_turns: int = 8,
               max_tool_calls_per_turn: int = 4):
    self._inner = ToolEnvironment(tools, self._score, parser=parser, max_turns=max_turns,
                                  max_tool_calls_per_turn=max_tool_calls_per_turn)
    self.tools = self._inner.tools
    self._task = None
    self._history: list[Message] = []
    self.rewards: dict[str, float | None] = {}

  def reset(self, example: Mapping[str, Any], seed: int) -> list[Message]:
    self._task = example["task"]
    self._history = _opening_messages(self._task)
    self.rewards = {}
    self._inner.reset({"prompt": ""}, seed)
    return list(self._history)

  def step(self, action: str) -> StepResult:
    self._history.append(Message("assistant", action))
    result = self._inner.step(action)
    self._history += list(result.messages)
    if result.done and self.rewards:
      result = dataclasses.replace(result, info={**result.info, "rewards": dict(self.rewards)})
    return result

  def _score(self, example: Mapping[str, Any], answer: str) -> float:
    del example, answer  # the task's rewards read the whole trace
    trace = _trace(self._task, self._history)
    _run_sync(self._task.score(trace))
    self.rewards = {k: (None if r is None else r.value) for k, r in trace.rewards.items()}
    return float(trace.reward)


def verifiers_spec(taskset: Any, eval_taskset: Any = None, name: str = "verifiers",
                   **env_kwargs: Any) -> EnvSpec:
  """An ``EnvSpec`` over a verifiers ``Taskset`` (tasks loaded now, in ``load()`` order).

  Examples are ``{"task": task, "prompt": text, "id": task.key}``; ``env_kwargs`` go to
  ``VerifiersEnvironment``.
  """
  def examples(ts):
    return [] if ts is None else [{"task": t, "prompt": t.data.prompt_text, "id": t.key}
                                  for t in ts]

  def make_env(example):
    del example
    return VerifiersEnvironment(**env_kwargs)

  return EnvSpec(name, make_env, examples(taskset), examples(eval_taskset), chat="model")
