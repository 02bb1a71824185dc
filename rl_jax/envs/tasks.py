"""Built-in agent tasks for tiny character-level models (built-in chat template, short turns).

``calculator``: multiply two numbers (2-3 digits each by default) -- too hard for a tiny model
in its head, easy with the "calc" tool called in the compact format. A solved episode::

    U:123*45
    A:<c>123*45</c><eos>T:5535
    A:5535<eos>

reward 1 for the right product (the final answer is the turn without a call).

``guess``: find a number in [1, n] from "higher"/"lower" feedback; reward 1 when found within
``max_turns`` guesses (binary search needs ceil(log2(n + 1))), 0 otherwise; an optional
per-guess penalty (off by default) shapes toward fewer guesses::

    U:guess 1-20
    A:10<eos>U:higher
    A:15<eos>U:lower
    A:12<eos>

``math_tools``: question/answer examples from a file (GSM8K or MATH format, read by the
trainer: ``rl_jax.train.agent_stage``) for a checkpoint's own chat template, with a sandboxed
Python tool (``rl_jax.envs.tools.PythonSandbox``) called in the template's tool-call format
(hermes for Qwen). A solved episode in Qwen's format::

    <|im_start|>system
    Solve the problem ... \\boxed{} ...  (then the template's tool list)<|im_end|>
    <|im_start|>user
    Tom has 3 apples and buys 4 more. How many apples?<|im_end|>
    <|im_start|>assistant
    <tool_call>{"name": "python", "arguments": {"code": "print(3 + 4)"}}</tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    7
    </tool_response><|im_end|>
    <|im_start|>assistant
    \\boxed{7}<|im_end|>

reward 1 when the final answer (the turn without a call; its last ``\\boxed{}``, else the
text after ``####``, else its last number) equals the reference (``rl_jax.data.verifiers``).
No expert.

Examples are deterministic given the seed; the built-in tasks' ``expert`` plays a correct
trajectory through the task's own environment (``rl_jax.envs.spec.run_episode``).
"""

from __future__ import annotations

import random
import re
from typing import Any, Callable, Mapping, Sequence

from rl_jax.data import verifiers
from rl_jax.envs.base import Message, StepResult
from rl_jax.envs.spec import EnvSpec, run_episode
from rl_jax.envs.tool_calls import ParsedTurn
from rl_jax.envs.tool_env import ToolEnvironment
from rl_jax.envs.tools import Calculator, PythonSandbox

__all__ = ["GuessEnvironment", "MATH_TOOLS_SYSTEM", "TASKS", "calculator_task",
           "calculator_examples", "calculator_expert_policy", "calculator_verifier",
           "guess_examples", "guess_expert_policy", "guess_task", "make_calculator_env",
           "make_math_tools_env", "make_task", "math_tools_task", "math_tools_verifier"]


# -- calculator --

def calculator_examples(n: int, seed: int, digits: tuple[int, int] = (2, 3),
                        exclude: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
  """``n`` distinct multiplication examples ``{"prompt": "a*b", "a", "b", "answer"}``.

  Args:
    n: number of examples.
    seed: random seed.
    digits: (min, max) number of digits of each factor.
    exclude: examples (by prompt) not to repeat, e.g. the other split.
  """
  lo, hi = 10 ** (digits[0] - 1), 10 ** digits[1] - 1
  space = (hi - lo + 1) ** 2 - len(exclude)
  if n > space:
    raise ValueError(f"asked for {n} examples but only {space} products of {digits} digits")
  rng = random.Random(seed)
  seen = {e["prompt"] for e in exclude}
  out = []
  while len(out) < n:
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    prompt = f"{a}*{b}"
    if prompt not in seen:
      seen.add(prompt)
      out.append({"prompt": prompt, "a": a, "b": b, "answer": str(a * b)})
  return out


def calculator_verifier(example: Mapping[str, Any], answer: str) -> float:
  """1.0 if the answer is exactly the product (surrounding spaces ignored)."""
  return 1.0 if answer.strip() == example["answer"] else 0.0


def calculator_expert_policy(messages: Sequence[Message]) -> str:
  """Call the calculator on the prompt, then answer with its result."""
  last = messages[-1]
  if last.role == "tool":
    return last.content.strip()
  return f"<c>{messages[0].content}</c>"


def make_calculator_env(example: Mapping[str, Any] | None = None,
                        max_turns: int = 3) -> ToolEnvironment:
  """The calculator task's environment: tool "calc", compact calls, one call per turn."""
  del example  # one environment type for every example
  return ToolEnvironment([Calculator("calc")], calculator_verifier, parser="compact",
                         max_tool_calls_per_turn=1, max_turns=max_turns)


def calculator_task(seed: int = 0, n_train: int = 2000, n_eval: int = 200,
                    digits: tuple[int, int] = (2, 3), max_turns: int = 3) -> EnvSpec:
  """The calculator task (module docstring); eval examples are disjoint from train."""
  eval_ex = calculator_examples(n_eval, seed + 1, digits)
  train = calculator_examples(n_train, seed, digits, exclude=eval_ex)

  def make_env(example):
    return make_calculator_env(example, max_turns)

  def expert(example, seed=0):
    return run_episode(make_env(example), example, calculator_expert_policy, seed).messages

  return EnvSpec("calculator", make_env, train, eval_ex, expert)


# -- guess the number --

class GuessEnvironment:
  """Guess a number in [1, n] with "higher"/"lower" feedback (module docstring).

  An answer that is not a number gets "invalid" and uses a turn. Per-turn reward is
  ``-step_penalty`` for a wrong guess (0 by default); the final reward is 1 when found.
  """

  tools: tuple = ()

  def __init__(self, max_turns: int = 5, step_penalty: float = 0.0):
    self.max_turns, self.step_penalty = max_turns, step_penalty
    self._target = self._n = None
    self._turns = 0

  def reset(self, example: Mapping[str, Any], seed: int) -> list[Message]:
    del seed
    self._target, self._n, self._turns = int(example["target"]), int(example["n"]), 0
    return [Message("user", str(example["prompt"]))]

  def step(self, action: str) -> StepResult:
    if self._target is None:
      raise RuntimeError("step() before reset()")
    self._turns += 1
    m = re.fullmatch(r"\s*(-?\d{1,9})\s*", action)
    guess = int(m.group(1)) if m else None
    if guess == self._target:
      return StepResult((), 1.0, True, {"turns": self._turns, "solved": True})
    if self._turns >= self.max_turns:
      return StepResult((), -self.step_penalty, True, {"turns": self._turns, "solved": False})
    if guess is None:
      feedback = "invalid"
    else:
      feedback = "higher" if self._target > guess else "lower"
    return StepResult((Message("user", feedback),), -self.step_penalty, False,
                      {"turns": self._turns})


def guess_examples(n_examples: int, seed: int, n: int = 20) -> list[dict[str, Any]]:
  """``n_examples`` examples ``{"prompt": "guess 1-n", "target", "n"}`` with random targets."""
  rng = random.Random(seed)
  return [{"prompt": f"guess 1-{n}", "target": rng.randint(1, n), "n": n}
          for _ in range(n_examples)]


def guess_expert_policy(messages: Sequence[Message]) -> str:
  """Binary search, replaying the feedback so far."""
  hi = int(messages[0].content.rsplit("-", 1)[1])
  lo = 1
  for prev, nxt in zip(messages, messages[1:]):
    if prev.role == "assistant" and prev.content.strip().isdigit():
      g = int(prev.content)
      if nxt.content == "higher":
        lo = max(lo, g + 1)
      elif nxt.content == "lower":
        hi = min(hi, g - 1)
  return str((lo + hi) // 2)


def guess_task(seed: int = 0, n_train: int = 2000, n: int = 20, max_turns: int = 5,
               step_penalty: float = 0.0) -> EnvSpec:
  """The guessing task (module docstring). The eval split is every target 1..n once (the
  target space is small, so train targets necessarily repeat them)."""
  train = guess_examples(n_train, seed, n)
  eval_ex = [{"prompt": f"guess 1-{n}", "target": t, "n": n} for t in range(1, n + 1)]

  def make_env(example):
    del example
    return GuessEnvironment(max_turns, step_penalty)

  def expert(example, seed=0):
    return run_episode(make_env(example), example, guess_expert_policy, seed).messages

  return EnvSpec("guess", make_env, train, eval_ex, expert)


# -- math with a Python tool (file examples, a checkpoint's chat template) --

MATH_TOOLS_SYSTEM = (
    "Solve the math problem. You can run Python with the python tool: it returns what the "
    "program prints. When you know the answer, reply without a tool call and put the final "
    "answer in \\boxed{}.")


def math_tools_verifier(example: Mapping[str, Any], answer: str) -> float:
  """1.0 if the final answer of ``answer`` (last ``\\boxed{}``, else after ``####``, else the
  last number) equals ``example["answer"]`` (``rl_jax.data.verifiers.math_reward``)."""
  return verifiers.math_reward(answer, str(example["answer"]))


def make_math_tools_env(parser: str | Callable[[str], ParsedTurn] = "hermes",
                        max_turns: int = 4, system_prompt: str = MATH_TOOLS_SYSTEM,
                        python_timeout_s: float = 5.0,
                        max_tool_calls_per_turn: int = 2) -> ToolEnvironment:
  """The math_tools environment: the "python" tool, calls in ``parser``'s format (a name of
  ``rl_jax.envs.tool_calls.PARSERS`` or a callable)."""
  return ToolEnvironment([PythonSandbox("python", timeout_s=python_timeout_s)],
                         math_tools_verifier, parser=parser,
                         max_tool_calls_per_turn=max_tool_calls_per_turn, max_turns=max_turns,
                         system_prompt=system_prompt or None)


def math_tools_task(train: Sequence[Mapping[str, Any]],
                    eval: Sequence[Mapping[str, Any]] = (),  # pylint: disable=redefined-builtin
                    parser: str = "hermes", max_turns: int = 4,
                    system_prompt: str = MATH_TOOLS_SYSTEM, python_timeout_s: float = 5.0,
                    max_tool_calls_per_turn: int = 2) -> EnvSpec:
  """The math_tools task (module docstring) over given examples.

  Args:
    train, eval: examples ``{"prompt": question, "answer": reference}``.
    parser: the tool-call format of the chat template ("hermes", "llama3").
    max_turns: assistant turns per episode.
    system_prompt: the system message ("" for none).
    python_timeout_s: wall-clock seconds per Python call.
    max_tool_calls_per_turn: calls run per assistant turn.
  """
  def make_env(example):
    del example  # one environment type for every example
    return make_math_tools_env(parser, max_turns, system_prompt, python_timeout_s,
                               max_tool_calls_per_turn)

  return EnvSpec("math_tools", make_env, list(train), list(eval), None, chat="model")


TASKS = {"calculator": calculator_task, "guess": guess_task, "math_tools": math_tools_task}


def make_task(name: str, **kwargs: Any) -> EnvSpec:
  """A task by name ("calculator", "guess", "math_tools") with its keyword arguments."""
  if name not in TASKS:
    raise ValueError(f"unknown agent task {name!r}; choose from {sorted(TASKS)}")
  return TASKS[name](**kwargs)
