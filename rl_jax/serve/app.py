"""The HTTP surface of ``rl_jax.serve``: OpenAI's ``/v1/models``, ``/v1/chat/completions``
and ``/v1/completions`` on FastAPI, over ``scheduler.Scheduler``.

Every error is OpenAI's JSON body with a 4xx status (a malformed body, wrong types, an
unknown model, limits, a prompt longer than the context, a wrong API key) and the server
keeps serving. A client that disconnects, streaming or not, has its choices cancelled and
their KV pages returned. The server never reads a file or runs code a request names.

Chat requests render their messages with the checkpoint's chat template (tools as JSON
schemas); with ``tools``, the finished text is parsed in the model's tool-call format
(``envs.tool_calls``) into ``tool_calls`` (``finish_reason`` "tool_calls"), and a streamed
answer with tools arrives as one chunk when the choice ends. Assistant messages a client
sends back with ``tool_calls`` are rendered the way the template writes calls (for the
built-in compact format: the call's tag, e.g. ``<c>2+3</c>``).
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import time
import uuid
from typing import Any, AsyncIterator

import fastapi
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rl_jax.envs import tool_calls
from rl_jax.serve import scoring
from rl_jax.serve import sessions as sessions_lib
from rl_jax.serve.protocol import ApiError, ChatMessage, ChatRequest, CompletionRequest, \
    error_body
from rl_jax.serve.scheduler import Chunk, Request, Sampling, Scheduler

__all__ = ["create_app"]


class _Service:
  """What the handlers share: the model, the scheduler and the limits."""

  def __init__(self, sched: Scheduler | None, model, api_key: str | None, max_n: int):
    self.sched, self.model, self.api_key, self.max_n = sched, model, api_key, max_n
    self.created = int(time.time())

  # ---------------------------------------------------------------- checks
  def check_key(self, request: fastapi.Request) -> None:
    if self.api_key is None:
      return
    got = request.headers.get("authorization", "")
    if not hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode()):
      raise ApiError(401, "Incorrect API key provided: pass it as 'Authorization: Bearer KEY'",
                     code="invalid_api_key")

  def check_model(self, name: str) -> None:
    if name != self.model.name:
      raise ApiError(404, f"The model {name!r} does not exist; this server serves "
                     f"{self.model.name!r}", param="model", code="model_not_found")

  def settings(self, body, max_tokens: int | None, default_max: int):
    """(Sampling, n, max_tokens, stop strings) of a body, checked against the limits."""
    if body.n > self.max_n:
      raise ApiError(400, f"n={body.n} is over this server's limit of {self.max_n}", param="n")
    limit = self.sched.max_tokens
    max_tokens = default_max if max_tokens is None else max_tokens
    if max_tokens > limit:
      raise ApiError(400, f"max_tokens={max_tokens} is over this server's limit of {limit} "
                     "(--max-tokens)", param="max_tokens")
    for name in ("frequency_penalty", "presence_penalty"):
      if getattr(body, name):
        raise ApiError(400, f"{name} is not supported", param=name)
    if body.logit_bias:
      raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    sampling = Sampling(1.0 if body.temperature is None else float(body.temperature),
                        1.0 if body.top_p is None else float(body.top_p),
                        int(body.top_k or 0))
    return sampling, body.n, max_tokens, body.stops()

  def check_prompt(self, ids: list[int], param: str) -> None:
    """The prompt's ids against the server's limits; errors name ``param``, the request's
    field that carried the prompt ("messages" or "prompt")."""
    if not ids:
      raise ApiError(400, "the prompt is empty", param=param)
    limit = self.sched.max_prompt_tokens
    if len(ids) > limit:
      raise ApiError(400, f"the prompt has {len(ids)} tokens, over this server's limit of "
                     f"{limit} (--max-prompt-tokens)", param=param,
                     code="context_length_exceeded")
    vocab = self.model.cfg.vocab_size
    if any(not 0 <= t < vocab for t in ids):
      raise ApiError(400, f"a prompt token id is outside the vocabulary [0, {vocab})",
                     param=param)

  # ---------------------------------------------------------------- chat rendering
  def render_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages as the dicts the chat template renders."""
    names, out = {}, []
    for m in messages:
      role = "system" if m.role == "developer" else m.role
      d: dict[str, Any] = {"role": role, "content": m.text()}
      if m.role == "assistant" and m.tool_calls:
        calls = []
        for c in m.tool_calls:
          try:
            args = json.loads(c.function.arguments or "{}")
          except json.JSONDecodeError:
            raise ApiError(400, f"tool call {c.id!r}: arguments are not JSON",
                           param="messages") from None
          names[c.id] = c.function.name
          calls.append((c.function.name, args))
        if self.model.parser == "compact":
          d["content"] += "".join(_compact_call(n, a) for n, a in calls)
        else:
          d["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}}
                             for n, a in calls]
      if m.role == "tool":
        if m.tool_call_id is not None:
          d["tool_call_id"] = m.tool_call_id
        name = m.name or names.get(m.tool_call_id)
        if name:
          d["name"] = name
      out.append(d)
    return out

  def chat_prompt(self, body: ChatRequest) -> list[int]:
    fmt = self.model.chat
    if fmt is None:
      raise ApiError(400, f"{self.model.name!r} has no chat template; use /v1/completions",
                     param="messages")
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    if tools and self.model.parser is None:
      raise ApiError(400, "this model's chat template shows no tool-call format (start the "
                     "server with --tool-parser)", param="tools")
    if body.tool_choice not in (None, "auto", "none"):
      raise ApiError(400, "tool_choice must be 'auto' or 'none' (forced calls are not "
                     "supported)", param="tool_choice")
    if body.tool_choice == "none":
      tools = []
    try:
      return fmt.prompt_ids(self.render_messages(body.messages), tools=tools)
    except ApiError:
      raise
    except Exception as e:  # the template refused the conversation (raise_exception)
      raise ApiError(400, f"the chat template cannot render these messages: "
                     f"{' '.join(str(e).split())}", param="messages") from None


def _compact_call(name: str, args: dict) -> str:
  for tag, (tool, arg) in tool_calls.COMPACT_TAGS.items():
    if tool == name and isinstance(args, dict) and arg in args:
      return f"<{tag}>{args[arg]}</{tag}>"
  raise ApiError(400, f"tool call {name!r} has no form in the compact format",
                 param="messages")


def _usage(prompt: int, completion: int) -> dict[str, int]:
  return {"prompt_tokens": prompt, "completion_tokens": completion,
          "total_tokens": prompt + completion}


async def _run(service: _Service, http: fastapi.Request, req: Request) -> AsyncIterator[Chunk]:
  """Submit ``req`` and yield its chunks; cancel it if the client leaves or we stop early."""
  loop = asyncio.get_running_loop()
  q: asyncio.Queue = asyncio.Queue()
  req.on_chunk = lambda item: loop.call_soon_threadsafe(q.put_nowait, item)
  service.sched.submit(req)
  try:
    while True:
      try:
        item = await asyncio.wait_for(q.get(), timeout=0.5)
      except asyncio.TimeoutError:
        if await http.is_disconnected():
          return
        continue
      if item is None:
        return
      if isinstance(item, Exception):
        raise ApiError(500, f"generation failed: {type(item).__name__}: {item}",
                       kind="server_error")
      yield item
  finally:
    if not req.done.is_set():
      service.sched.cancel(req)


def _sse(event: dict[str, Any]) -> str:
  return f"data: {json.dumps(event)}\n\n"


async def _streamed(gen: AsyncIterator[Chunk], head: dict[str, Any], prompt_len: int,
                    stream_options, render) -> StreamingResponse:
  """The server-sent events of a streamed answer: one event per chunk with the choice
  ``render(chunk)`` builds, an error event if generation fails, the usage event when
  ``stream_options.include_usage``, then ``[DONE]``. The first chunk is awaited before the
  response starts, so errors before it are still plain 4xx/5xx answers."""
  try:
    first = await gen.__anext__()
  except StopAsyncIteration:
    first = None

  async def events():
    chunk, used = first, 0
    try:
      while chunk is not None:
        used += len(chunk.ids)
        yield _sse({**head, "choices": [await render(chunk)]})
        chunk = await gen.__anext__()
    except StopAsyncIteration:
      pass
    except ApiError as e:
      yield _sse(e.body())
      return
    if stream_options is not None and stream_options.include_usage:
      yield _sse({**head, "choices": [], "usage": _usage(prompt_len, used)})
    yield "data: [DONE]\n\n"

  return StreamingResponse(events(), media_type="text/event-stream")


def create_app(sched: Scheduler | None = None, *, model=None, sessions=None,
               api_key: str | None = None, max_n: int = 8) -> FastAPI:
  """The FastAPI application (module docstring): the OpenAI routes over ``sched`` and, with
  ``sessions`` (a ``sessions.SessionHub``), the training sessions' routes
  ``/s/{session}/v1/...`` over the trainer's engine (``model``: what it serves, for the
  chat format and the tool-call format)."""
  app = FastAPI(title="rl_jax.serve", docs_url=None, redoc_url=None, openapi_url=None)
  model = sched.model if sched is not None else model
  service = _Service(sched, model, api_key, max_n)

  @app.exception_handler(ApiError)
  async def _api_error(_, e: ApiError):
    return JSONResponse(e.body(), status_code=e.status)

  @app.exception_handler(RequestValidationError)
  async def _invalid(_, e: RequestValidationError):
    err = e.errors()[0] if e.errors() else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    where = ".".join(loc)
    msg = err.get("msg", "invalid request").removeprefix("Value error, ")
    if err.get("type") == "json_invalid":  # its loc is a character offset, not a field
      where, msg = "", "the request body is not valid JSON"
    return JSONResponse(error_body(f"{where}: {msg}" if where else msg, param=where or None),
                        status_code=400)

  @app.exception_handler(StarletteHTTPException)
  async def _http(_, e: StarletteHTTPException):
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return JSONResponse(error_body(str(e.detail), kind), status_code=e.status_code)

  if sessions is not None:
    _session_routes(app, service, sessions)
  if sched is None:
    return app

  @app.get("/health")
  async def health():
    return {"status": "ok", "model": model.name, "active_choices": sched.active_choices(),
            **sched.shared_prompts(), **sched.cached_prefixes()}

  @app.get("/v1/models")
  async def list_models(http: fastapi.Request):
    service.check_key(http)
    return {"object": "list", "data": [{"id": model.name, "object": "model",
                                        "created": service.created, "owned_by": "rl_jax"}]}

  @app.post("/v1/chat/completions")
  async def chat(body: ChatRequest, http: fastapi.Request):
    service.check_key(http)
    service.check_model(body.model)
    max_tokens = body.max_completion_tokens or body.max_tokens
    sampling, n, max_tokens, stops = service.settings(body, max_tokens, sched.max_tokens)
    _check_response_format(body)
    if body.top_logprobs is not None and not body.logprobs:
      raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    prompt = service.chat_prompt(body)
    service.check_prompt(prompt, "messages")
    parse = (tool_calls.get_parser(model.parser)
             if body.tools and body.tool_choice != "none" else None)
    k = (body.top_logprobs or 0) if body.logprobs else 0
    req = Request(prompt, n, max_tokens, sampling, seed=body.seed, stop=stops,
                  stream=body.stream and parse is None)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "created": created, "model": model.name}

    async def logprobs(prefix: list[int], ids: list[int], lps: list[float]):
      if not body.logprobs:
        return None
      lps, alts = await _alternatives(model, prefix, ids, lps, sampling, k)
      return {"content": [_token_entry(model.tokenizer, t, lp, alt)
                          for t, lp, alt in zip(ids, lps, alts)]}

    def message(text: str, finish: str | None):
      if parse is None:
        return {"role": "assistant", "content": text}, finish
      turn = parse(text)
      if not turn.calls:
        return {"role": "assistant", "content": text}, finish
      calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments))}}
               for c in turn.calls]
      return ({"role": "assistant", "content": turn.content.strip() or None,
               "tool_calls": calls}, "tool_calls")

    if not body.stream:
      async for _ in _run(service, http, req):
        pass
      if not req.done.is_set():
        return JSONResponse(error_body("client disconnected"), status_code=499)
      choices, used = [], 0
      for c in req.result():
        msg, finish = message(c.text, c.finish)
        choices.append({"index": c.index, "message": msg, "finish_reason": finish,
                        "logprobs": await logprobs(prompt, c.ids, c.logprobs)})
        used += len(c.ids)
      return {**head, "object": "chat.completion", "choices": choices,
              "usage": _usage(len(prompt), used)}

    started, sent = set(), {}  # choices begun; ids reported per choice

    async def chat_choice(chunk: Chunk) -> dict[str, Any]:
      delta = {}
      if chunk.index not in started:
        started.add(chunk.index)
        delta["role"] = "assistant"
      finish = chunk.finish
      if parse is not None:  # the whole choice in one chunk, calls parsed
        msg, finish = message(chunk.text, chunk.finish)
        delta.update({k: v for k, v in msg.items() if k != "role" and v is not None})
      elif chunk.text:
        delta["content"] = chunk.text
      prefix = prompt + sent.get(chunk.index, [])
      sent[chunk.index] = sent.get(chunk.index, []) + chunk.ids
      return {"index": chunk.index, "delta": delta, "finish_reason": finish,
              "logprobs": await logprobs(prefix, chunk.ids, chunk.logprobs)}

    return await _streamed(_run(service, http, req), {**head, "object": "chat.completion.chunk"},
                           len(prompt), body.stream_options, chat_choice)

  @app.post("/v1/completions")
  async def completions(body: CompletionRequest, http: fastapi.Request):
    service.check_key(http)
    service.check_model(body.model)
    if body.echo:
      raise ApiError(400, "echo is not supported", param="echo")
    if body.suffix:
      raise ApiError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
      raise ApiError(400, f"best_of={body.best_of} is not supported (only best_of = n)",
                     param="best_of")
    sampling, n, max_tokens, stops = service.settings(body, body.max_tokens, 16)
    prompt = _completion_prompt(model.tokenizer, body.prompt)
    service.check_prompt(prompt, "prompt")
    k = body.logprobs
    req = Request(prompt, n, max_tokens, sampling, seed=body.seed, stop=stops,
                  stream=body.stream)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": model.name}

    async def logprobs(prefix: list[int], ids: list[int], lps: list[float], offset: int):
      if k is None:
        return None
      lps, alts = await _alternatives(model, prefix, ids, lps, sampling, k)
      toks = [model.tokenizer.decode([t]) for t in ids]
      offsets = [offset + x for x in itertools.accumulate([0] + [len(t) for t in toks])]
      return {"tokens": toks, "token_logprobs": lps,
              "top_logprobs": [{model.tokenizer.decode([i]): v for i, v in alt} if k else None
                               for alt in alts],
              "text_offset": offsets[:len(toks)]}

    if not body.stream:
      async for _ in _run(service, http, req):
        pass
      if not req.done.is_set():
        return JSONResponse(error_body("client disconnected"), status_code=499)
      choices, used = [], 0
      for c in req.result():
        choices.append({"index": c.index, "text": c.text, "finish_reason": c.finish,
                        "logprobs": await logprobs(prompt, c.ids, c.logprobs, 0)})
        used += len(c.ids)
      return {**head, "object": "text_completion", "choices": choices,
              "usage": _usage(len(prompt), used)}

    sent, chars = {}, {}  # ids and characters reported per choice

    async def text_choice(chunk: Chunk) -> dict[str, Any]:
      prefix = prompt + sent.get(chunk.index, [])
      sent[chunk.index] = sent.get(chunk.index, []) + chunk.ids
      lp = await logprobs(prefix, chunk.ids, chunk.logprobs, chars.get(chunk.index, 0))
      chars[chunk.index] = chars.get(chunk.index, 0) + len(chunk.text)
      return {"index": chunk.index, "text": chunk.text, "finish_reason": chunk.finish,
              "logprobs": lp}

    return await _streamed(_run(service, http, req), {**head, "object": "text_completion"},
                           len(prompt), body.stream_options, text_choice)

  return app


async def _alternatives(model, prefix: list[int], ids: list[int], lps: list[float], sampling,
                        k: int):
  """(log-probs, top-k alternatives) of ``ids``: the engine's log-probs and, when asked, the
  alternatives of a scoring pass; a greedy choice's both from the model's softmax
  (``scoring``)."""
  if not k and sampling.temperature > 0:
    return lps, [[] for _ in ids]
  scored, alts = await asyncio.to_thread(scoring.top_logprobs, model.cfg, model.params, prefix,
                                         ids, sampling, k)
  return (scored if sampling.temperature <= 0 else lps), alts


_SESSION_REFUSED = ("temperature", "top_p", "top_k", "seed", "logit_bias", "frequency_penalty",
                    "presence_penalty")


def _session_routes(app: FastAPI, service: _Service, hub) -> None:
  """``/s/{session}/v1/models`` and ``/s/{session}/v1/chat/completions`` of training
  sessions (``sessions``): answers are the engine's turns."""
  model = service.model

  @app.get("/s/{session}/v1/models")
  async def session_models(session: str, http: fastapi.Request):
    service.check_key(http)
    hub.get(session)
    return {"object": "list", "data": [{"id": model.name, "object": "model",
                                        "created": service.created, "owned_by": "rl_jax"}]}

  @app.post("/s/{session}/v1/chat/completions")
  async def session_chat(session: str, body: ChatRequest, http: fastapi.Request):
    service.check_key(http)
    env = hub.get(session)
    service.check_model(body.model)
    _check_response_format(body)
    for name in _SESSION_REFUSED:
      if getattr(body, name):
        raise ApiError(400, f"{name}: a training session samples with the run's rollout "
                       "settings; leave it unset", param=name)
    for name, bad in (("n", body.n != 1), ("stream", body.stream),
                      ("logprobs", body.logprobs)):
      if bad:
        raise ApiError(400, f"{name} is not supported in a training session", param=name)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    text = await asyncio.wrap_future(env.deliver(body.messages, tools))
    content, calls = sessions_lib.assistant_reply(text, hub.parser)
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    finish = "stop"
    if calls:
      finish = "tool_calls"
      msg["tool_calls"] = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                            "function": {"name": n, "arguments": json.dumps(a)}}
                           for n, a in calls]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": model.name,
            "choices": [{"index": 0, "message": msg, "finish_reason": finish,
                         "logprobs": None}]}


def _check_response_format(body: ChatRequest) -> None:
  """A 400 for a ``response_format`` other than plain text (no constrained decoding)."""
  kind = (body.response_format or {}).get("type", "text")
  if kind != "text":
    raise ApiError(400, f"response_format of type {kind!r} is not supported (text only)",
                   param="response_format")


def _completion_prompt(tokenizer, prompt) -> list[int]:
  """Token ids of a completions ``prompt``: text, or token ids; one prompt per request."""
  if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
    if len(prompt) != 1:
      raise ApiError(400, "send one prompt per request (lists of prompts are not supported)",
                     param="prompt")
    prompt = prompt[0]
  if isinstance(prompt, str):
    return list(tokenizer.encode(prompt))
  return [int(t) for t in prompt]


def _token_entry(tokenizer, token: int, logprob: float, alts) -> dict[str, Any]:
  """One entry of a chat choice's ``logprobs.content``."""
  text = tokenizer.decode([token])
  return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")),
          "top_logprobs": [{"token": tokenizer.decode([i]), "logprob": v,
                            "bytes": list(tokenizer.decode([i]).encode("utf-8"))}
                           for i, v in alts]}
