"""Agent sessions over HTTP against the in-process environment loop: trajectories per second.

The same multi-turn episodes, the same weights and the same engine (``rollout.AgentEngine``),
played two ways, alternating (lockstep, so a noisy host slows both alike):

* in-process: an environment that answers each assistant turn with a user message;
* HTTP: an agent function written against the OpenAI client that does the same, each episode
  a session of ``rl_jax.serve.sessions`` (``/s/{session}/v1/chat/completions`` on
  127.0.0.1), as ``env.agent`` trains it.

Both give the same trajectories (``tests/test_serve_train.py`` checks it token for token);
the difference is the cost of HTTP, JSON, the client and the session hand-offs. The model
is a random character-level Llama large enough that decoding dominates (d = 512 by default).

    python scripts/bench_serve.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import jax
import numpy as np
import openai

from rl_jax import models
from rl_jax.data.tokenizers import CharTokenizer
from rl_jax.envs import Message, StepResult
from rl_jax.envs.chat import ChatFormat
from rl_jax.rollout import AgentEngine
from rl_jax.rollout.agent_records import EpisodeSpec
from rl_jax.serve import app as app_lib
from rl_jax.serve import sessions
from rl_jax.serve.checkpoint import ServedModel

TURNS = 3
_client: list[openai.OpenAI] = []
_lock = threading.Lock()


def agent(base_url: str, api_key: str, example: dict) -> float:
  """Three turns: the question, then "go on" after each answer; reward = answer length."""
  with _lock:
    if not _client:
      _client.append(openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0,
                                   timeout=600))
  client = _client[0].with_options(base_url=base_url, api_key=api_key)
  messages = [{"role": "user", "content": example["prompt"]}]
  total = 0
  for t in range(TURNS):
    reply = client.chat.completions.create(model="policy", messages=messages).choices[0]
    messages.append(reply.message.model_dump(exclude_none=True))
    total += len(reply.message.content or "")
    if t + 1 < TURNS:
      messages.append({"role": "user", "content": "go on"})
  return float(total)


class Local:
  """``agent`` as an in-process environment."""

  tools = ()

  def reset(self, example, seed):
    del seed
    self.turns, self.total = 0, 0
    return [Message("user", example["prompt"])]

  def step(self, action):
    self.turns += 1
    self.total += len(action)
    if self.turns >= TURNS:
      return StepResult((), float(self.total), True)
    return StepResult((Message("user", "go on"),), 0.0, False)


def main() -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--hidden", type=int, default=512)
  p.add_argument("--layers", type=int, default=4)
  p.add_argument("--sessions", type=int, default=32, help="concurrent episodes (G·M)")
  p.add_argument("--samples", type=int, default=4, help="M: samples per episode's prompt")
  p.add_argument("--episodes", type=int, default=16, help="groups per measurement")
  p.add_argument("--turn-tokens", type=int, default=32)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args()

  tok = CharTokenizer()
  d = args.hidden
  cfg = models.ModelConfig(vocab_size=tok.vocab_size, hidden_size=d, intermediate_size=3 * d,
                           num_layers=args.layers, num_heads=d // 64, num_kv_heads=d // 128,
                           head_dim=64, max_position_embeddings=512, dtype="float32",
                           param_dtype="float32")
  params = models.init_params(cfg, jax.random.key(0), std=0.02)
  fmt = ChatFormat.builtin(tok)
  G = args.sessions // args.samples

  def engine():
    return AgentEngine(cfg, fmt, tok.decode, n=args.samples, max_slots=G, max_prompt_len=32,
                       max_total_tokens=TURNS * (args.turn_tokens + 8), max_turns=TURNS,
                       max_turn_tokens=args.turn_tokens, max_obs_tokens=8, temperature=1.0,
                       ttl=None, step_timeout=None, workers=2 * args.sessions,
                       stop_ids=[tok.eos_id])

  served = ServedModel("policy", cfg, None, tok, fmt, None, (tok.eos_id,))

  def start(hub):
    return sessions.start_uvicorn(app_lib.create_app(model=served, sessions=hub,
                                                     api_key=hub.api_key),
                                  sessions.free_port())

  hub = sessions.SessionHub(agent, start, parser=None)
  examples = [{"prompt": f"{i}*{i + 7}"} for i in range(args.episodes)]
  ways = {"in-process": (engine(), lambda ex: EpisodeSpec(Local, ex)),
          "http": (engine(), lambda ex: EpisodeSpec(hub.make_env, ex))}
  rates = {k: [] for k in ways}
  for r in range(args.repeats + 1):  # the first round compiles and warms up
    for name, (eng, spec) in ways.items():
      t0 = time.perf_counter()
      out = eng.rollout(params, [spec(ex) for ex in examples], first_uid=1000 * r)
      dt = time.perf_counter() - t0
      if r:
        rates[name].append(len(out.reward) / dt)
      if r == 0 and name == "http":
        assert out.num_turns.min() == TURNS, "every session plays all its turns"
  row = {k: float(np.median(v)) for k, v in rates.items()}
  row["ratio"] = row["http"] / row["in-process"]
  row.update(hidden=d, layers=args.layers, sessions=args.sessions, turns=TURNS,
             turn_tokens=args.turn_tokens, trajectories=args.episodes * args.samples,
             all=rates)
  print(json.dumps(row))


if __name__ == "__main__":
  main()
