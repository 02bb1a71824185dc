"""Agents written only against the OpenAI API, trained through ``env.agent`` (they know
nothing of rl_jax: a base URL, a key and an example in, a reward out).

``calculator_agent`` plays the calculator task as its in-process environment does: the
question as the user message, the ``calc`` tool, the tool's answer as a tool message, at
most 3 assistant turns, reward 1 for the exact product as the final answer.
"""

import itertools
import json
import re
import threading

import openai

CALC = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression, e.g. 12*(3+4).",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                   "required": ["expr"]}}}


def multiply(expr: str) -> str:
  """The product of ``a*b`` (integers), as the calculator prints it; an error text else."""
  m = re.fullmatch(r"\s*(\d+)\s*\*\s*(\d+)\s*", expr or "")
  return str(int(m.group(1)) * int(m.group(2))) if m else "error: not a product of integers"


_shared: list[openai.OpenAI] = []
_lock = threading.Lock()


def client_for(base_url: str, api_key: str) -> openai.OpenAI:
  """A client of ``base_url``. Building an ``openai.OpenAI`` costs ~20 ms (its HTTP client's
  TLS setup); ``with_options`` shares one connection pool between every episode's client."""
  with _lock:
    if not _shared:
      _shared.append(openai.OpenAI(base_url=base_url, api_key=api_key, timeout=300))
  return _shared[0].with_options(base_url=base_url, api_key=api_key)


def calculator_agent(base_url: str, api_key: str, example: dict) -> float:
  client = client_for(base_url, api_key)
  messages = [{"role": "user", "content": example["prompt"]}]
  for _ in range(3):
    reply = client.chat.completions.create(model="policy", messages=messages,
                                           tools=[CALC]).choices[0].message
    messages.append(reply.model_dump(exclude_none=True))
    if not reply.tool_calls:
      return float((reply.content or "").strip() == example["answer"])
    call = reply.tool_calls[0]
    expr = json.loads(call.function.arguments).get("expr", "")
    messages.append({"role": "tool", "tool_call_id": call.id, "name": "calc",
                     "content": multiply(expr)})
  return 0.0


def crashing_agent(base_url: str, api_key: str, example: dict) -> float:
  """Makes one request, then fails (its episodes end with reward 0; the run goes on)."""
  calculator_agent_once(base_url, api_key, example)
  raise RuntimeError("the agent broke")


_CALLS = itertools.count()


def non_number_agent(base_url: str, api_key: str, example: dict):
  """Makes one request, then returns NaN or the string "1.0", in turn (neither is a reward:
  its episodes fail, reward 0)."""
  calculator_agent_once(base_url, api_key, example)
  return float("nan") if next(_CALLS) % 2 else "1.0"


def silent_agent(base_url: str, api_key: str, example: dict) -> float:
  """Returns without a request: its episodes have no opening prompt."""
  return 1.0


def calculator_agent_once(base_url: str, api_key: str, example: dict):
  return client_for(base_url, api_key).chat.completions.create(
      model="policy", messages=[{"role": "user", "content": example["prompt"]}],
      tools=[CALC])


def rewriting_agent(base_url: str, api_key: str, example: dict) -> float:
  """Sends its conversation back with the question changed: the server refuses it (400)."""
  client = client_for(base_url, api_key)
  messages = [{"role": "user", "content": example["prompt"]}]
  reply = client.chat.completions.create(model="policy", messages=messages).choices[0].message
  messages = [{"role": "user", "content": "something else"},
              reply.model_dump(exclude_none=True), {"role": "user", "content": "and?"}]
  client.chat.completions.create(model="policy", messages=messages)
  return 1.0


def greeting_agent(base_url: str, api_key: str, example: dict) -> float:
  """Opens every session with "hello" instead of the task's prompt for its example."""
  client_for(base_url, api_key).chat.completions.create(
      model="policy", messages=[{"role": "user", "content": "hello"}])
  return 1.0
