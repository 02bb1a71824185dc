"""The OpenAI-compatible request bodies (pydantic) and error bodies of ``rl_jax.serve``.

Fields follow OpenAI's chat-completions and completions APIs. Unknown fields are ignored (as
OpenAI's own clients send fields a server may not use); fields that would change the output
and are not implemented (penalties, ``logit_bias``, ``echo``, ``suffix``, ``best_of`` other
than ``n``, a ``response_format`` other than text, forced tool choice, content parts other
than text) are refused with a 400 rather than ignored. ``top_k`` is accepted as an extension.
"""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ApiError", "ChatMessage", "ChatRequest", "CompletionRequest", "ToolDef",
           "error_body"]


class ApiError(Exception):
  """An error answered in OpenAI's format: HTTP ``status`` and the body's fields."""

  def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error",
               param: str | None = None, code: str | None = None):
    super().__init__(message)
    self.status, self.message, self.kind, self.param, self.code = (status, message, kind,
                                                                   param, code)

  def body(self) -> dict[str, Any]:
    return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
  """``{"error": {message, type, param, code}}`` as OpenAI writes it."""
  return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class _Body(BaseModel):
  model_config = ConfigDict(extra="ignore")


class FunctionDef(_Body):
  name: str = Field(min_length=1)
  description: str | None = None
  parameters: dict[str, Any] | None = None


class ToolDef(_Body):
  type: Literal["function"]
  function: FunctionDef


class FunctionCall(_Body):
  name: str
  arguments: str


class ToolCallIn(_Body):
  id: str | None = None
  type: Literal["function"] = "function"
  function: FunctionCall


class TextPart(_Body):
  type: Literal["text"]
  text: str


class ChatMessage(_Body):
  role: Literal["system", "developer", "user", "assistant", "tool"]
  content: str | list[TextPart] | None = None
  name: str | None = None
  tool_calls: list[ToolCallIn] | None = None
  tool_call_id: str | None = None

  @pydantic.field_validator("content", mode="before")
  @classmethod
  def _text_only(cls, v):
    if isinstance(v, list):
      for part in v:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
          raise ValueError(f"content parts of type {kind!r} are not supported (text only)")
    elif v is not None and not isinstance(v, str):
      raise ValueError("content must be a string or a list of text parts")
    return v

  def text(self) -> str:
    if self.content is None:
      return ""
    if isinstance(self.content, str):
      return self.content
    return "".join(p.text for p in self.content)


class StreamOptions(_Body):
  include_usage: bool = False


class _Sampled(_Body):
  """Fields both endpoints share."""

  model: str
  n: int = Field(1, ge=1)
  max_tokens: int | None = Field(None, ge=1)
  temperature: float | None = Field(None, ge=0.0, le=2.0)
  top_p: float | None = Field(None, gt=0.0, le=1.0)
  top_k: int | None = Field(None, ge=0)
  seed: int | None = None
  stop: str | list[str] | None = None
  stream: bool = False
  stream_options: StreamOptions | None = None
  frequency_penalty: float | None = None
  presence_penalty: float | None = None
  logit_bias: dict[str, float] | None = None

  @pydantic.field_validator("stop")
  @classmethod
  def _stops(cls, v):
    if isinstance(v, list) and len(v) > 4:
      raise ValueError("at most 4 stop strings")
    return v

  def stops(self) -> list[str]:
    if self.stop is None:
      return []
    return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatRequest(_Sampled):
  messages: list[ChatMessage] = Field(min_length=1)
  tools: list[ToolDef] | None = None
  tool_choice: Any = None
  logprobs: bool = False
  top_logprobs: int | None = Field(None, ge=0, le=20)
  max_completion_tokens: int | None = Field(None, ge=1)
  response_format: dict[str, Any] | None = None


class CompletionRequest(_Sampled):
  prompt: str | list[int] | list[str] | list[list[int]]
  logprobs: int | None = Field(None, ge=0, le=20)
  echo: bool = False
  suffix: str | None = None
  best_of: int | None = None

  @pydantic.field_validator("prompt", mode="before")
  @classmethod
  def _prompt_kind(cls, v):
    ids = lambda x: isinstance(x, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)
    if not (isinstance(v, str) or ids(v) or isinstance(v, list) and (
        all(isinstance(x, str) for x in v) or all(ids(x) for x in v))):
      raise ValueError("must be a string or a list of integer token ids")
    return v
