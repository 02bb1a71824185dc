"""``python -m rl_jax.serve``: the real ``openai`` client against the server on localhost.

Two tiny checkpoints: a random character-level model exported as a run exports it (weights
and ``rl_jax_tokenizer.json``), served by the CLI in a subprocess; and a model built to be
a Markov chain over a small word-level HF tokenizer with a hermes-style chat template, whose
greedy answer is a tool call, served in-process. Numbers are checked against independent
computations: the engine's log-probs against one ``models.forward`` pass, greedy answers
against argmax decoding with ``models.forward``.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from rl_jax import models
from rl_jax.data.tokenizers import CharTokenizer, save_tokenizer
from rl_jax.envs import tool_calls
from rl_jax.errors import RLJaxError
from rl_jax.rollout.records import RolloutError
from rl_jax.serve import __main__ as serve_cli
from rl_jax.serve import scoring
from rl_jax.serve.app import create_app
from rl_jax.serve.checkpoint import ServeError, load_served
from rl_jax.serve.scheduler import Request, Sampling, Scheduler, choice_pages

uvicorn = pytest.importorskip("uvicorn")

KEY = "test-key"
TOK = CharTokenizer()
CHAR_CFG = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=48,
                              num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                              max_position_embeddings=256, dtype="float32",
                              param_dtype="float32")


def _port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def char_dir(tmp_path_factory):
  d = str(tmp_path_factory.mktemp("char_hf"))
  params = models.init_params(CHAR_CFG, jax.random.key(0), std=0.2)
  models.save_hf(CHAR_CFG, params, d)
  save_tokenizer("char", d)
  return d


@pytest.fixture(scope="module")
def server(char_dir):
  """The CLI serving the character model; yields (base_url, process)."""
  port = _port()
  proc = subprocess.Popen(
      [sys.executable, "-m", "rl_jax.serve", f"--model={char_dir}", f"--port={port}",
       f"--api-key={KEY}", "--max-tokens=48", "--max-prompt-tokens=64", "--max-n=4",
       "--max-slots=4", "--served-model-name=tiny"],
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  url = f"http://127.0.0.1:{port}"
  deadline = time.time() + 120
  while True:
    try:
      if httpx.get(f"{url}/health", timeout=1).status_code == 200:
        break
    except httpx.HTTPError:
      pass
    if proc.poll() is not None or time.time() > deadline:
      proc.kill()
      pytest.fail(f"server did not start: {proc.stdout.read()}")
    time.sleep(0.3)
  yield url, proc
  proc.terminate()
  proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
  return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=KEY, max_retries=0)


def _chat(client, content="2+3?", **kw):
  kw.setdefault("max_tokens", 24)
  return client.chat.completions.create(
      model="tiny", messages=[{"role": "user", "content": content}], **kw)


def test_chat_is_seeded_batch_invariant_and_streams_the_same_text(client):
  """A seeded request gives the same choices alone, with n=2, under concurrent load and
  streamed; different seeds differ."""
  one = _chat(client, seed=7)
  assert one.model == "tiny" and one.choices[0].message.role == "assistant"
  assert one.usage.prompt_tokens == len(TOK.encode("U:2+3?\nA:"))
  text = one.choices[0].message.content
  assert text and one.choices[0].finish_reason in ("stop", "length")
  two = _chat(client, seed=7, n=2)
  assert two.choices[0].message.content == text  # choice i's stream: (seed, i)
  assert two.choices[1].message.content != text
  assert _chat(client, seed=8).choices[0].message.content != text

  results = [None] * 6

  def worker(i):
    results[i] = _chat(client, content=f"{i}*{i}?", seed=i, max_tokens=12 + 5 * i)
  threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  for i in range(6):  # decoded together in one batch, alone they give the same text
    alone = _chat(client, content=f"{i}*{i}?", seed=i, max_tokens=12 + 5 * i)
    assert results[i].choices[0].message.content == alone.choices[0].message.content

  parts, usage = [], None
  for chunk in _chat(client, seed=7, stream=True, stream_options={"include_usage": True}):
    if chunk.choices:
      parts.append(chunk.choices[0].delta.content or "")
    else:
      usage = chunk.usage
  assert len(parts) > 1 and "".join(parts) == text
  assert usage.completion_tokens == one.usage.completion_tokens


def test_completions_logprobs_and_stop_strings(client):
  full = client.completions.create(model="tiny", prompt="hello", max_tokens=30, seed=3,
                                   logprobs=2)
  c = full.choices[0]
  lp = c.logprobs
  assert "".join(lp.tokens) == c.text and len(lp.token_logprobs) == len(lp.tokens)
  assert all(np.isfinite(x) and x <= 0 for x in lp.token_logprobs)
  assert all(1 <= len(alt) <= 2 for alt in lp.top_logprobs)
  assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
  for tok, x, alt in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
    if tok in alt:  # the engine's record and the scoring pass agree where both report
      assert abs(alt[tok] - x) < 1e-4
  # a stop string cuts the text before it and ends the choice
  stop = c.text[len(c.text) // 2]
  cut = client.completions.create(model="tiny", prompt="hello", max_tokens=30, seed=3,
                                  stop=[stop])
  assert cut.choices[0].text == c.text[:c.text.index(stop)]
  assert cut.choices[0].finish_reason == "stop"
  streamed = "".join(ch.choices[0].text for ch in client.completions.create(
      model="tiny", prompt="hello", max_tokens=30, seed=3, stop=[stop], stream=True))
  assert streamed == cut.choices[0].text
  ids = client.completions.create(model="tiny", prompt=TOK.encode("hello"), max_tokens=30,
                                  seed=3)
  assert ids.choices[0].text == c.text  # token ids in, the same text out


def _post(url, body, key=KEY, raw=None):
  headers = {"Authorization": f"Bearer {key}"} if key else {}
  if raw is not None:
    return httpx.post(url, content=raw, headers={**headers, "Content-Type": "application/json"},
                      timeout=60)
  return httpx.post(url, json=body, headers=headers, timeout=60)


@pytest.mark.parametrize("body,key,raw,status,param", [
    (None, KEY, b"{not json", 400, None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": "many"}, KEY,
     None, 400, "n"),
    ({"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}, KEY, None, 400,
     "messages.0.role"),
    ({"model": "tiny", "messages": []}, KEY, None, 400, "messages"),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, KEY, None, 404,
     "model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 5}, KEY, None,
     400, "n"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 49}, KEY,
     None, 400, "max_tokens"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x" * 80}]}, KEY, None, 400,
     "messages"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 3},
     KEY, None, 400, "temperature"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
      "presence_penalty": 1.0}, KEY, None, 400, "presence_penalty"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, "wrong", None, 401,
     None),
    ({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, None, None, 401, None),
])
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, body, key,
                                                                     raw, status, param):
  r = _post(f"{server[0]}/v1/chat/completions", body, key, raw)
  assert r.status_code == status, r.text
  err = r.json()["error"]
  assert err["message"] and err["type"]
  if param is not None:
    assert err["param"] == param
  if status == 400 and body and "x" * 80 in json.dumps(body):
    assert err["code"] == "context_length_exceeded"
  assert _chat(client, max_tokens=4).choices[0].message.content is not None


def test_bad_completion_prompts_and_routes(server):
  url = server[0]
  r = _post(f"{url}/v1/completions", {"model": "tiny", "prompt": [5, 10_000]})
  assert r.status_code == 400 and "vocabulary" in r.json()["error"]["message"]
  assert r.json()["error"]["param"] == "prompt"
  r = _post(f"{url}/v1/completions", {"model": "tiny", "prompt": [5] * 80})
  err = r.json()["error"]
  assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
  assert err["param"] == "prompt"  # the field of this route ("messages" on the chat route)
  r = _post(f"{url}/v1/completions", {"model": "tiny", "prompt": ["a", "b"]})
  assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
  r = _post(f"{url}/v1/completions", {"model": "tiny", "prompt": "a", "echo": True})
  assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
  r = _post(f"{url}/v1/nothing", {})
  assert r.status_code == 404 and "error" in r.json()
  # fields that would change the answer and are not implemented are refused, not ignored;
  # each error names its field
  hi = [{"role": "user", "content": "hi"}]
  for route, body, param, message in [
      ("completions", {"prompt": "a", "best_of": 3}, "best_of",
       "best_of=3 is not supported (only best_of = n)"),
      ("completions", {"prompt": [1.5, 2]}, "prompt",
       "prompt: must be a string or a list of integer token ids"),
      ("chat/completions", {"messages": hi, "response_format": {"type": "json_object"}},
       "response_format", "response_format of type 'json_object' is not supported (text only)"),
      ("chat/completions", {"messages": hi, "top_logprobs": 2}, "top_logprobs",
       "top_logprobs needs logprobs=true"),
      ("chat/completions", {"messages": [{"role": "user", "content": [
          {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
       "messages.0.content",
       "messages.0.content: content parts of type 'image_url' are not supported (text only)"),
      ("chat/completions", None, None, "the request body is not valid JSON"),
  ]:
    r = _post(f"{url}/v1/{route}", body and {"model": "tiny", **body},
              raw=None if body else b"{1")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["message"] == message
  # what these fields allow is served: best_of = n, a text response_format, text parts
  assert _post(f"{url}/v1/completions", {"model": "tiny", "prompt": "a", "best_of": 1,
                                         "max_tokens": 2}).status_code == 200
  r = _post(f"{url}/v1/chat/completions", {
      "model": "tiny", "max_tokens": 2, "response_format": {"type": "text"},
      "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
  assert r.status_code == 200, r.text


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server, client):
  url = server[0]
  with httpx.stream("POST", f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                    json={"model": "tiny", "prompt": "abc", "max_tokens": 48, "stream": True,
                          "temperature": 0.5}, timeout=60) as r:
    next(r.iter_lines())  # the first chunk arrived: the choice is decoding; hang up
  deadline = time.time() + 30
  while httpx.get(f"{url}/health").json()["active_choices"] and time.time() < deadline:
    time.sleep(0.2)
  health = httpx.get(f"{url}/health").json()
  # the prompts in the slots' caches (no --prompt-pages): nothing forks
  assert health["active_choices"] == 0
  assert health["forked_choices"] == health["prompt_tokens_shared"] == 0
  assert server[1].poll() is None


def test_cli_errors_are_one_line(tmp_path, char_dir):
  def run(*args):
    p = subprocess.run([sys.executable, "-m", "rl_jax.serve", *args], capture_output=True,
                       text=True, timeout=120)
    return p.returncode, p.stderr.strip().splitlines()

  code, lines = run(f"--model={tmp_path}/missing")
  assert code == 2 and lines[-1].startswith("error: --model=") and "not a directory" in lines[-1]
  code, lines = run(f"--model={char_dir}", "--host=0.0.0.0")
  assert code == 2 and "--api-key" in lines[-1]
  code, lines = run(f"--model={char_dir}", f"--seed={2**64}")
  assert code == 2 and lines[-1] == f"error: --seed={2**64} must lie in [-2**63, 2**63)"
  models.save_hf(CHAR_CFG, models.init_params(CHAR_CFG, jax.random.key(1)), str(tmp_path / "b"))
  code, lines = run(f"--model={tmp_path}/b")
  assert code == 2 and "has no tokenizer" in lines[-1] and "--tokenizer" in lines[-1]


@pytest.mark.parametrize("flags,message", [
    (["--port=70000"], "--port=70000 must lie in [1, 65535]"),
    (["--port={busy}"], "cannot listen on 127.0.0.1:{busy} (Address already in use)"),
    (["--max-prompt-tokens=0"], "--max-prompt-tokens=0 must be at least 1"),
    (["--max-tokens=0"], "--max-tokens=0 must be at least 1"),
    (["--prefix-cache=-1"], "--prefix-cache=-1 must be at least 0 (0: no cache)"),
    (["--kv-pages=0"], "--kv-pages=0 must be at least 1"),
    (["--kv-pages=1"], "--kv-pages=1 holds less than one choice's whole budget "
                       "(--max-tokens=128): 2 pages of up to 64 tokens"),
    (["--kv-pages=4", "--prompt-pages", "--page-size=32"],
     "--kv-pages=4 holds less than one choice's whole budget (--max-prompt-tokens=128 + "
     "--max-tokens=128): 8 pages of up to 32 tokens"),
    (["--max-prompt-tokens=300"], "--max-prompt-tokens=300 leaves no room for new tokens in "
                                  "the model's context of 256 positions"),
    (["--served-model-name="], "--served-model-name='' must not be empty (unset: the "
                               "directory's name)"),
    (["--model={plain}", "--tool-parser=foo"],  # no chat template: no parser is chosen
     "--tool-parser='foo': choose auto or one of ['compact', 'hermes', 'llama3', 'qwen']"),
], ids=["port_range", "port_busy", "prompt_0", "tokens_0", "prefix_cache", "kv_pages_0",
        "kv_pages_short", "kv_pages_prompt_short", "prompt_fills_context",
        "empty_name", "tool_parser"])
def test_cli_flag_errors_come_before_serving(monkeypatch, tmp_path, char_dir, tool_dir, flags,
                                             message):
  """Each wrong flag stops ``main`` with its own line before it serves ({busy}: a port that
  another socket listens on; {plain}: a checkpoint without a chat template)."""
  monkeypatch.setattr(uvicorn, "run", lambda *a, **k: pytest.fail("the server started"))
  plain = shutil.copytree(tool_dir, tmp_path / "plain",
                          ignore=shutil.ignore_patterns("chat_template.jinja"))
  with socket.socket() as busy:
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    names = dict(busy=busy.getsockname()[1], plain=plain)
    with pytest.raises(RLJaxError) as err:
      serve_cli.main([f"--model={char_dir}", f"--port={_port()}",
                      *(f.format(**names) for f in flags)])
  assert str(err.value) == message.format(**names)


def test_tool_parser_help_names_every_parser():
  (action,) = [a for a in serve_cli._parser()._actions if a.dest == "tool_parser"]
  assert sorted(action.help.replace(" or ", ", ").split(", ")) == sorted(
      ["auto", *tool_calls.PARSERS])


# ---------------------------------------------------------------- in-process: exact numbers
@pytest.fixture(scope="module")
def char_scheduler(char_dir):
  sched = Scheduler(load_served(char_dir), max_slots=4, max_prompt_tokens=64, max_tokens=40)
  yield sched
  sched.close()


def _submit(sched, prompt, **kw):
  req = Request(prompt, kw.pop("n", 1), kw.pop("max_tokens", 40), kw.pop("sampling", Sampling()),
                **kw)
  sched.submit(req)
  assert req.done.wait(120)
  return req.result()


def test_engine_logprobs_equal_one_forward_pass(char_scheduler):
  """Sampled at temperature 0.7 with top-p 0.9: every recorded log-prob equals the scoring
  pass's (an independent full forward), and every token is inside the top-p set."""
  m = char_scheduler.model
  prompt = TOK.encode("U:what is 12+30?\nA:")
  sampling = Sampling(temperature=0.7, top_p=0.9)
  outs = [_submit(char_scheduler, prompt, sampling=sampling, seed=s)[0] for s in range(3)]
  for out in outs:
    assert out.ids
    scored, _ = scoring.top_logprobs(m.cfg, m.params, prompt, out.ids, sampling, 1)
    np.testing.assert_allclose(out.logprobs, scored, atol=2e-5)


def test_greedy_equals_argmax_decoding_with_forward(char_scheduler):
  m = char_scheduler.model
  prompt = TOK.encode("U:hello there\nA:")
  out = _submit(char_scheduler, prompt, sampling=Sampling(temperature=0.0), max_tokens=20)[0]
  ids = np.zeros((1, 64), np.int32)  # causal: the padding after a position changes nothing
  ids[0, :len(prompt)] = prompt
  forward = jax.jit(lambda t: models.forward(m.cfg, m.params, t))
  for n in range(len(prompt), len(prompt) + len(out.ids)):
    ids[0, n] = int(jnp.argmax(forward(jnp.asarray(ids))[0, n - 1]))
  assert out.ids == ids[0, len(prompt):len(prompt) + len(out.ids)].tolist()


def test_prompts_on_pages_take_pages_for_their_length(char_dir, char_scheduler):
  """``prompt_pages`` (``--prompt-pages``): a choice's prompt after its first id is written
  onto pool pages, so the slot's own prompt cache holds 8 positions instead of
  ``max_prompt_tokens`` and a choice holds pages for its prompt and output only; greedy
  and seeded sampled choices are those of the layout with the prompt in the slot
  (``char_scheduler``), and sampled log-probs those of an independent forward pass."""
  model = load_served(char_dir)
  model.cfg = model.cfg.replace(max_position_embeddings=1024)
  short, long = TOK.encode("U:hi\nA:"), TOK.encode("U:" + "x" * 48 + "\nA:")
  greedy = Sampling(temperature=0.0)
  # budgets over 256 tokens: a pool that grows as the choices need it
  sched = Scheduler(model, max_slots=2, max_prompt_tokens=256, max_tokens=256, page_size=16,
                    prompt_pages=True)
  try:
    for prompt in (short, long):
      lane = sched._lanes.get(greedy)
      before = len(lane.loop.used) if lane else 0
      ids = _submit(sched, prompt, sampling=greedy, max_tokens=8, stop=["\u0000"])[0].ids
      assert ids == _submit(char_scheduler, prompt, sampling=greedy, max_tokens=8)[0].ids
      assert len(ids) == 8
      # pages of 16 tokens: the prompt's ids after the first and the 8 output tokens
      lane = sched._lanes[greedy]
      assert max(lane.loop.used[before:]) == -(-(len(prompt) - 1 + 8) // 16)
    assert [-(-(len(p) - 1 + 8) // 16) for p in (short, long)] == [1, 4]
    assert lane.loop.state.prefix_k[0].shape[-1] == 8  # the slot's prompt cache: 8 at least
    sampling, chunks = Sampling(temperature=0.7), []
    out = _submit(sched, long, sampling=sampling, seed=5, max_tokens=12, stream=True,
                  on_chunk=lambda c: chunks.append(c) if c is not None else None)[0]
    scored, _ = scoring.top_logprobs(model.cfg, model.params, long, out.ids, sampling, 1)
    assert out.ids and np.allclose(out.logprobs, scored, atol=2e-5)
    # the same seed's sampled choice of the prompt in the slot: the uniforms skip the
    # prompt's ids on the sample's pages (``DecodeState.skip``)
    assert out.ids == _submit(char_scheduler, long, sampling=sampling, seed=5,
                              max_tokens=12)[0].ids
    # streamed as it decodes: the output's ids and text only, never the prompt's
    assert [i for c in chunks for i in c.ids] == out.ids
    assert "".join(c.text for c in chunks) == out.text
  finally:
    sched.close()


def test_choices_with_one_prompt_prefill_and_hold_it_once(char_dir):
  """Prompts on pages: the n choices of a request, and a concurrent request with the same
  prompt, take the first choice's whole prompt pages (``share_prompts``) instead of each
  prefilling its own; a request whose prompt begins like it (one long first message, then
  another question) takes the whole pages they have in common and prefills the rest. Their
  ids equal those of a server that shares nothing, log-probs to float rounding, with fewer
  pages held."""
  model = load_served(char_dir)
  model.cfg = model.cfg.replace(max_position_embeddings=1024)
  text = "U:" + "how much is 17 times 23? " * 3
  prompt, variant = TOK.encode(text + "\nA:"), TOK.encode(text + "and 4 + 5?\nA:")
  sampling = Sampling(temperature=1.0)
  outs, peaks, forks = [], [], []
  for share in (True, False):
    # budgets over 256 tokens: a pool that grows as the choices need it (a page table)
    sched = Scheduler(model, max_slots=6, max_prompt_tokens=256, max_tokens=256, page_size=16,
                      prompt_pages=True, share_prompts=share, max_lanes=1)
    try:
      reqs = [Request(p, n, 16, sampling, seed=seed)
              for p, n, seed in ((prompt, 3, 1), (prompt, 1, 2), (variant, 1, 3))]
      for r in reqs:
        sched.submit(r)
      assert all(r.done.wait(120) for r in reqs)
      outs.append([c for r in reqs for c in r.result()])
      loop = sched._lanes[sampling].loop  # pylint: disable=protected-access
      peaks.append(max(loop.used))
      forks.append((loop.stats["forked_samples"], loop.stats["fork_tokens_shared"]))
      counted = dict(zip(("forked_choices", "prompt_tokens_shared"), forks[-1]))
      assert sched.shared_prompts() == counted
      _submit(sched, prompt, sampling=Sampling(temperature=0.0), max_tokens=2)
      assert sampling not in sched._lanes  # pylint: disable=protected-access
      assert sched.shared_prompts() == counted  # the dropped lane's counts are kept
    finally:
      sched.close()
  whole = (len(prompt) - 2) // 16  # the prompt's whole pages after its first id
  common = (len(text) - 1) // 16  # the whole pages the variant has in common with it
  assert whole >= 4 and common == 4
  assert forks == [(4, 3 * (len(prompt) - 2) + 16 * common), (0, 0)]
  assert peaks[0] <= peaks[1] - 3 * whole - common
  for a, b in zip(*outs):
    assert a.ids == b.ids and a.finish == b.finish and a.ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_chats_next_request_takes_the_last_ones_pages_from_the_prefix_cache(char_dir):
  """Prompts on pages with the prefix cache: when a choice ends its whole pages stay; the
  chat's next request (the last prompt, its answer, a new message) forks them and
  prefills only the rest, with the ids of a server that keeps nothing and log-probs to
  float rounding. A request that needs more pages than are free drops the cache's least
  recently used entries (their pages free again) before the pool grows."""
  model = load_served(char_dir)
  model.cfg = model.cfg.replace(max_position_embeddings=1024)
  first = TOK.encode("U:" + "how much is 17 times 23? " * 3 + "\nA:")
  sampling = Sampling(temperature=1.0)
  runs = []
  for share in (True, False):
    sched = Scheduler(model, max_slots=2, max_prompt_tokens=256, max_tokens=256, page_size=16,
                      prompt_pages=True, share_prompts=share)
    try:
      one = _submit(sched, first, sampling=sampling, seed=1, max_tokens=24)[0]
      loop = sched._lanes[sampling].loop  # pylint: disable=protected-access
      kept = [(c.ids.copy(), c.pages.copy()) for c in loop.cache.values()]
      after = first + one.ids + TOK.encode("\nU:and 4 + 5?\nA:")
      two = _submit(sched, after, sampling=sampling, seed=2, max_tokens=16)[0]
      runs.append((one, two, kept, dict(sched.cached_prefixes()),
                   loop.stats["fork_tokens_shared"]))
      if share:  # two long prompts of their own: the pool is short, the cache gives back
        size, before = loop.state.refs.size, [c.ids for c in loop.cache.values()]
        reqs = [Request(TOK.encode("U:" + ch * 230 + "\nA:"), 1, 4, sampling, seed=3)
                for ch in "qz"]
        for r in reqs:
          sched.submit(r)
        assert all(r.done.wait(120) for r in reqs)
        now = [c.ids for c in loop.cache.values()]
        dropped = (len(before), any(len(c) == len(b) and (c == b).all() for c in now
                                    for b in before), loop.state.refs.size, size)
    finally:
      sched.close()
  (one, two, kept, cache, shared), (one_, two_, kept_, cache_, shared_) = runs
  assert one.ids == one_.ids and two.ids == two_.ids and two.ids
  np.testing.assert_allclose(two.logprobs, two_.logprobs, atol=1e-5)
  k = (len(first) - 1 + len(one.ids)) // 16 * 16  # positions whose K/V the first kept
  assert len(kept) == 1 and kept[0][0].tolist() == (first[1:] + one.ids)[:k]
  assert len(kept[0][1]) == k // 16 and kept_ == [] and cache_["prefix_cache_entries"] == 0
  assert cache["prefix_cache_hits"] == 1 and shared == k and shared_ == 0
  entries, still_kept, size_after, size_before = dropped
  assert entries == 1 and not still_kept and size_after == size_before  # dropped, no growth


def test_a_fixed_pool_takes_the_prefix_caches_pages_back_before_it_runs_short(char_dir):
  """``kv_pages``: a fixed pool of one choice's whole budget, with the prefix cache (the
  shapes of the test above, so its programs). A chat's next request forks the cache as on a
  growing pool; answers whose pages outgrow the free ones take back those of the cache's
  least recently used entry while they decode (nothing is preempted), and a prompt that
  fits only without an entry's pages is admitted once they are given back: the ids of a
  server that keeps nothing, log-probs to float rounding, and the pool never grows."""
  model = load_served(char_dir)
  model.cfg = model.cfg.replace(max_position_embeddings=1024)
  first = TOK.encode("U:" + "how much is 17 times 23? " * 3 + "\nA:")
  sampling = Sampling(temperature=1.0)
  answer = TOK.encode("U:" + "count with me: " * 8 + "\nA:")  # 9 pages, then 10
  grows = TOK.encode("U:" + "say it again: " * 12 + "\nA:")  # 11 pages, then 15
  prompt = TOK.encode("U:" + "spell it out, " * 14 + "\nA:")  # 13 pages from the start
  need = choice_pages(256, 256, 16, True)
  with pytest.raises(RolloutError, match="^kv_pages=31 holds less than one choice's whole"):
    Scheduler(model, max_prompt_tokens=256, max_tokens=256, page_size=16, prompt_pages=True,
              kv_pages=need - 1)
  runs = []
  for kv_pages, share in ((need, True), (None, False)):
    sched = Scheduler(model, max_slots=2, max_prompt_tokens=256, max_tokens=256, page_size=16,
                      prompt_pages=True, share_prompts=share, kv_pages=kv_pages)
    try:
      one = _submit(sched, first, sampling=sampling, seed=1, max_tokens=24)[0]
      loop = sched._lanes[sampling].loop  # pylint: disable=protected-access
      chat = first + one.ids + TOK.encode("\nU:and 4 + 5?\nA:")
      outs, caches = [one], []
      for ids, seed, tokens in ((chat, 2, 16), (answer, 5, 64), (grows, 6, 64), (prompt, 4, 8)):
        outs.append(_submit(sched, ids, sampling=sampling, seed=seed, max_tokens=tokens)[0])
        caches.append([c.ids.tolist() for c in loop.cache.values()])
        if len(outs) == 2:
          only = loop.cache_only()[0].tolist()  # pages the cache alone holds: free if dropped
      runs.append(dict(outs=outs, hits=loop.cache_hits, caches=caches, only=only,
                       pool=loop.state.refs.size, stats=dict(loop.stats)))
    finally:
      sched.close()
  fixed, plain = runs
  for a, b in zip(fixed["outs"], plain["outs"]):
    assert a.ids == b.ids and a.finish == b.finish and a.ids
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  one, two, answered, grown, long_prompt = fixed["outs"]
  def kept(prompt, out):  # whole pages of the K/V written: every id but the last one sampled
    fed = len(prompt) - 1 + len(out.ids) + (out.finish == "stop") - 1  # (an end id: unreported)
    return (prompt[1:] + out.ids)[:fed // 16 * 16]

  assert fixed["hits"] == 1 and fixed["stats"]["fork_tokens_shared"] == len(kept(first, one))
  assert grown.finish == "length"  # 15 pages: more than were free beside the two entries
  # the chat's entry extends the first's, which it replaced; the answer's joins it; the
  # growing answer takes back the chat's pages (least recently used), the prompt the answer's
  assert fixed["caches"] == [[kept(chat, two)], [kept(chat, two), kept(answer, answered)],
                             [kept(answer, answered), kept(grows, grown)],
                             [kept(grows, grown), kept(prompt, long_prompt)]]
  assert fixed["only"] == [len(kept(chat, two)) // 16] and plain["only"] == [0]
  assert fixed["stats"]["preemptions"] == 0 and fixed["pool"] == plain["pool"] == need == 32


def test_cancel_stops_decoding_and_returns_the_pages(char_dir):
  """Long choices on a pool smaller than their budgets (pages taken as tokens are written):
  cancelled mid-generation, they leave the batch and every page returns to the pool."""
  model = load_served(char_dir)
  model.cfg = model.cfg.replace(max_position_embeddings=1024)
  sched = Scheduler(model, max_slots=2, max_prompt_tokens=16, max_tokens=512, page_size=16)
  try:
    req = Request(TOK.encode("U:go\nA:"), 2, 512, Sampling(temperature=1.0), stream=True)
    got = []
    req.on_chunk = got.append
    sched.submit(req)
    deadline = time.time() + 60
    while not any(getattr(c, "ids", None) for c in got) and time.time() < deadline:
      time.sleep(0.02)
    sched.cancel(req)
    assert req.done.wait(30)
    while sched.active_choices() and time.time() < deadline:
      time.sleep(0.02)
    lane = sched._lanes[Sampling(temperature=1.0)]  # pylint: disable=protected-access
    loop = lane.loop
    assert not loop.identity  # a real page table
    assert all(len(c.ids) < 512 for c in req.choices)  # stopped before their budgets
    loop.give_back()
    assert not np.asarray(loop.state.refs).any()  # every page is free again
    assert not bool(np.asarray(loop.state.active).any())
  finally:
    sched.close()


# ---------------------------------------------------------------- tools: a Markov-chain model
CALL = '{"name": "add", "arguments": {"a": 2, "b": 3}}'
WORDS = ["[UNK]", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", CALL, "user",
         "assistant", "system", "tool", "hello", "5"]
CHAIN = {"assistant": "<tool_call>", "<tool_call>": CALL, CALL: "</tool_call>",
         "</tool_call>": "<|im_end|>"}
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tool_dir(tmp_path_factory):
  """A 1-layer model whose attention and MLP write nothing: the logits depend on the last
  token only, and the lm-head makes CHAIN's successor the argmax by a margin of 32."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  d = str(tmp_path_factory.mktemp("tool_hf"))
  _markov_model(d)  # first: save_hf replaces the directory
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_tokens([tokenizers.AddedToken(w, normalized=False) for w in WORDS[3:6]])
  tok.add_special_tokens([tokenizers.AddedToken(w, normalized=False) for w in WORDS[1:3]])
  tok.save(os.path.join(d, "tokenizer.json"))
  with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<|im_end|>", "pad_token": "<|im_end|>"}, f)
  with open(os.path.join(d, "chat_template.jinja"), "w") as f:
    f.write(TEMPLATE)
  return d


def _markov_model(d: str) -> None:
  """Save the 1-layer chain model of ``tool_dir`` to ``d``."""
  cfg = models.ModelConfig(vocab_size=len(WORDS), hidden_size=32, intermediate_size=32,
                           num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
                           max_position_embeddings=512, dtype="float32", param_dtype="float32")
  p = jax.device_get(models.init_params(cfg, jax.random.key(0)))
  q, _ = np.linalg.qr(np.random.default_rng(0).normal(size=(32, 32)))
  embed = (q[:len(WORDS)] * np.sqrt(32)).astype(np.float32)  # orthogonal rows, rms 1
  head = np.zeros((32, len(WORDS)), np.float32)
  for src, dst in CHAIN.items():
    head[:, WORDS.index(dst)] = embed[WORDS.index(src)]
  p = {**p, "embed": embed, "lm_head": head, "final_norm": np.ones(32, np.float32),
       "layers": {**p["layers"], "o": np.zeros_like(p["layers"]["o"]),
                  "down": np.zeros_like(p["layers"]["down"])}}
  models.save_hf(cfg, p, d)


@contextlib.contextmanager
def _serving(app):
  port = _port()
  srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
  thread = threading.Thread(target=srv.run, daemon=True)
  thread.start()
  while not srv.started:
    time.sleep(0.05)
  try:
    yield f"http://127.0.0.1:{port}/v1"
  finally:
    srv.should_exit = True
    thread.join(timeout=30)


def test_chat_with_tools_returns_parsed_tool_calls(tool_dir):
  model = load_served(tool_dir)
  assert model.parser == "hermes" and model.chat is not None
  sched = Scheduler(model, max_slots=2, max_prompt_tokens=256, max_tokens=16)
  tools = [{"type": "function", "function": {
      "name": "add", "description": "a + b", "parameters": {
          "type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}]
  messages = [{"role": "user", "content": "hello"}]
  try:
    with _serving(create_app(sched)) as url:
      client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
      r = client.chat.completions.create(model=model.name, messages=messages, tools=tools,
                                         temperature=0)
      choice = r.choices[0]
      assert choice.finish_reason == "tool_calls"
      (call,) = choice.message.tool_calls
      assert call.function.name == "add" and json.loads(call.function.arguments) == {
          "a": 2, "b": 3}
      assert r.usage.completion_tokens == 3  # <tool_call>, the call, </tool_call>
      # the conversation continues with the call and its result
      messages += [choice.message.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": "5"}]
      again = client.chat.completions.create(model=model.name, messages=messages, tools=tools,
                                             temperature=0)
      assert again.choices[0].message.tool_calls[0].function.name == "add"
      streamed = list(client.chat.completions.create(model=model.name, messages=messages[:1],
                                                     tools=tools, temperature=0, stream=True))
      deltas = [c.choices[0].delta for c in streamed]
      assert deltas[0].tool_calls[0].function.name == "add"
      assert streamed[-1].choices[0].finish_reason == "tool_calls"
      plain = client.chat.completions.create(model=model.name, messages=messages[:1],
                                             temperature=0, logprobs=True)
      assert plain.choices[0].message.tool_calls is None  # no tools: the text as it is
      assert "<tool_call>" in plain.choices[0].message.content
      lps = [e.logprob for e in plain.choices[0].logprobs.content]
      assert len(lps) == 3 and all(-1e-3 < x <= 0 for x in lps)  # the chain's margin
  finally:
    sched.close()


def test_loading_errors_are_one_line(tmp_path, char_dir):
  with pytest.raises(ServeError, match="has no config.json"):
    load_served(str(tmp_path))
  with pytest.raises(ServeError, match="--tool-parser='xml'"):
    load_served(char_dir, tool_parser="xml")


@pytest.fixture(scope="module")
def char_adapter(char_dir, tmp_path_factory):
  """A PEFT adapter directory (r=2 on q and v) whose base is ``char_dir``."""
  cfg = CHAR_CFG.replace(lora_rank=2, lora_alpha=4.0, lora_targets=("q", "v"))
  params = models.lora.combine(models.init_params(CHAR_CFG, jax.random.key(0)),
                               models.lora.init_adapters(cfg, jax.random.key(1)))
  d = str(tmp_path_factory.mktemp("char_adapter"))
  models.save_hf_adapter(cfg, params, d, base_model_name_or_path=char_dir)
  return d


def _without(key):
  return lambda c: {k: v for k, v in c.items() if k != key}


@pytest.mark.parametrize("adapter,fname,edit,message", [
    (False, "config.json", lambda c: {**c, "rope_scaling": {"rope_type": "yarn", "factor": "x"}},
     "config.json RoPE scaling factor='x' must be a positive number"),
    (False, "config.json", lambda c: {**c, "rope_scaling": ["yarn", 4]},
     "config.json rope_scaling=['yarn', 4] must be a JSON object or null"),
    (False, "config.json", lambda c: {**c, "rope_theta": "1e4"},
     "config.json rope_theta='1e4' must be a positive number"),
    (False, "config.json", lambda c: [c], "config.json must hold a JSON object, not a list"),
    (True, "adapter_config.json", lambda c: {**c, "lora_alpha": "4"},
     "adapter_config.json lora_alpha='4' must be a number"),
    (True, "adapter_config.json", lambda c: {**c, "r": "2"},
     "adapter_config.json r='2' must be a positive integer"),
], ids=["rope_factor", "rope_scaling_list", "rope_theta", "config_list", "string_alpha",
        "string_r"])
def test_bad_checkpoint_files_fail_at_load_in_one_line(tmp_path, char_dir, char_adapter,
                                                       adapter, fname, edit, message):
  path = str(shutil.copytree(char_adapter if adapter else char_dir, tmp_path / "m"))
  with open(os.path.join(path, fname)) as f:
    data = json.load(f)
  with open(os.path.join(path, fname), "w") as f:
    json.dump(edit(data), f)
  with pytest.raises(ServeError) as err:
    load_served(path)
  assert str(err.value) == f"--model={path}: {message}"


def test_an_adapter_without_lora_alpha_takes_pefts(tmp_path, char_adapter):
  """PEFT reads an adapter_config.json without lora_alpha as alpha 8; so does the server."""
  import peft  # pylint: disable=import-outside-toplevel  (torch: only this test needs it)
  path = str(shutil.copytree(char_adapter, tmp_path / "m"))
  with open(os.path.join(path, "adapter_config.json")) as f:
    data = json.load(f)
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(_without("lora_alpha")(data), f)
  assert peft.LoraConfig.from_pretrained(path).lora_alpha == 8
  assert load_served(path).cfg.lora_alpha == 8.0


def test_a_tensor_in_two_weight_files_is_one_line(tmp_path, char_dir):
  """Two safetensors files without an index that both hold a tensor (a stale shard beside a
  newer export): one line naming both, not the alphabetically last silently."""
  path = str(shutil.copytree(char_dir, tmp_path / "m"))
  shutil.copy(os.path.join(path, "model.safetensors"), os.path.join(path, "old.safetensors"))
  with pytest.raises(ServeError) as err:
    load_served(path)
  assert " is in both " in str(err.value) and "old.safetensors" in str(err.value)
  assert "\n" not in str(err.value)
