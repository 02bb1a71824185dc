"""A tool-use environment: the model calls tools until it answers; a verifier scores the answer.

Each assistant turn is parsed for tool calls (``rl_jax.envs.tool_calls``). A turn with calls
(parsed or malformed) gets one "tool" message per call -- the tool's output or a
``ToolError`` observation -- and reward 0. A turn without a call is the final answer: the
episode ends with reward ``verifier(example, answer_text)``. Reaching ``max_turns`` while
still calling tools ends the episode with reward 0 (``info["truncated"]``).

``info`` per turn: ``{"tool_calls": n, "tool_errors": {kind: count}, "tool_latency_s": t}``
(plus ``"truncated"`` or ``"verifier_error"`` when they happen).
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from rl_jax.envs.base import Message, StepResult, Tool
from rl_jax.envs.tool_calls import ParsedTurn, get_parser
from rl_jax.envs.tools import ToolError, call_tool

__all__ = ["ToolEnvironment", "Verifier"]

log = logging.getLogger(__name__)

Verifier = Callable[[Mapping[str, Any], str], float]


class ToolEnvironment:
  """One tool-use episode (see the module docstring).

  Args:
    tools: the tools (``rl_jax.envs.base.Tool``).
    verifier: ``(example, answer_text) -> reward``.
    parser: tool-call format: "hermes"/"qwen", "llama3", "compact", or a callable
      ``text -> ParsedTurn``.
    max_tool_calls_per_turn: calls beyond this in one turn are not run (one
      "too_many_calls" error message instead).
    max_turns: assistant turns before the episode is cut off.
    system_prompt: an optional system message.
    prompt_key: the example's field holding the user prompt.
  """

  def __init__(self, tools: Sequence[Tool], verifier: Verifier,
               parser: str | Callable[[str], ParsedTurn] = "hermes",
               max_tool_calls_per_turn: int = 4, max_turns: int = 8,
               system_prompt: str | None = None, prompt_key: str = "prompt"):
    self.tools = tuple(tools)
    self._by_name = {t.name: t for t in self.tools}
    self.verifier = verifier
    self.parse = get_parser(parser)
    self.max_tool_calls_per_turn = max_tool_calls_per_turn
    self.max_turns = max_turns
    self.system_prompt = system_prompt
    self.prompt_key = prompt_key
    self._example: Mapping[str, Any] | None = None
    self._turns = 0

  def reset(self, example: Mapping[str, Any], seed: int) -> list[Message]:
    del seed  # deterministic given the example
    self._example, self._turns = example, 0
    opening = [Message("system", self.system_prompt)] if self.system_prompt else []
    return opening + [Message("user", str(example[self.prompt_key]))]

  def step(self, action: str) -> StepResult:
    if self._example is None:
      raise RuntimeError("step() before reset()")
    self._turns += 1
    parsed = self.parse(action)
    if not parsed.has_calls:
      return self._final(parsed.content)
    messages, errors, latency = self._run_calls(parsed)
    info = {"tool_calls": len(parsed.calls) + len(parsed.errors), "tool_errors": errors,
            "tool_latency_s": latency}
    if self._turns >= self.max_turns:
      return StepResult((), 0.0, True, {**info, "truncated": True})
    return StepResult(tuple(messages), 0.0, False, info)

  def _final(self, answer: str) -> StepResult:
    info: dict[str, Any] = {"tool_calls": 0, "tool_errors": {}, "tool_latency_s": 0.0}
    try:
      reward = float(self.verifier(self._example, answer))
    except Exception as e:  # pylint: disable=broad-except
      log.warning("verifier failed: %s: %s", type(e).__name__, e)
      reward, info["verifier_error"] = 0.0, f"{type(e).__name__}: {e}"
    return StepResult((), reward, True, info)

  def _run_calls(self, parsed: ParsedTurn) -> tuple[list[Message], dict[str, int], float]:
    """Run the parsed calls; returns (tool messages, error counts by kind, seconds)."""
    messages: list[Message] = []
    errors: collections.Counter = collections.Counter()
    start = time.perf_counter()
    for call in parsed.calls[:self.max_tool_calls_per_turn]:
      out = call_tool(self._by_name, call.name, call.arguments)
      if isinstance(out, ToolError):
        errors[out.kind] += 1
      messages.append(Message("tool", str.__str__(out), name=call.name))
    latency = time.perf_counter() - start
    extra = len(parsed.calls) - self.max_tool_calls_per_turn
    if extra > 0:
      errors["too_many_calls"] += 1
      messages.append(Message("tool", str.__str__(ToolError(
          "too_many_calls", f"{extra} calls over the limit of "
          f"{self.max_tool_calls_per_turn} per turn were not run"))))
    for err in parsed.errors:
      errors[err.kind] += 1
      messages.append(Message("tool", str.__str__(ToolError(err.kind, err.message)),
                              name=err.name))
    return messages, dict(errors), latency
