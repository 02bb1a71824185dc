"""Multi-turn rollouts: continuous batching across turns vs a turn-synchronous baseline.

Every environment step calls a tool that sleeps ``--sleep`` seconds (50 ms by default).
The schedules run on the same ``AgentEngine`` (same slots, model, episodes and device
programs); ``schedule="turn_sync"`` makes every sample wait for the slowest tool call of its
turn before all continue together, while ``continuous`` keeps decoding the other samples
while tools run, and with a KV time-to-live (``--ttl``) lends the slot of a group whose
samples all wait on tools to waiting work (Continuum); ``lockstep`` is continuous batching
with the deterministic schedule (``AgentEngine(deterministic=True)``: the steps submitted in
one iteration are applied at the start of the next, no evictions; the trainer's schedule
with ``rollout.partial``).
They are timed in interleaved repeats after a warm-up call each (compiles excluded) and
must return identical trajectories (the environments are deterministic).

Usage::

    python scripts/bench_agent.py                     # about a minute on 2 CPU cores
    python scripts/bench_agent.py --groups 32 --repeats 5

Prints one markdown row: trajectories/s of each schedule and the speed-up.

Reference: "Continuum: Efficient and Robust Multi-Turn LLM Agent Scheduling with KV Cache
Time-to-Live" (2025).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax import models, rollout  # noqa: E402
from rl_jax.data.tokenizers import CharTokenizer  # noqa: E402
from rl_jax.envs import Message, StepResult  # noqa: E402

TOK = CharTokenizer()


class ChatRenderer:
  """"<role>:<content>\\n" per message, then "A:" (the assistant's turn header)."""

  end_of_turn_ids = [TOK.eos_id]
  ROLE = {"system": "S", "user": "U", "tool": "T", "assistant": "A"}

  def _text(self, messages):
    return "".join(f"{self.ROLE[m.role]}:{m.content}\n" for m in messages)

  def prompt_ids(self, messages, tools=()):
    del tools
    return TOK.encode(self._text(messages) + "A:")

  def delta_ids(self, history, new):
    del history
    return TOK.encode("\n" + self._text(new) + "A:")


class SleepTool:
  """A tool that sleeps, then answers with the call's length."""

  name, description, parameters = "sleep", "waits, then echoes", {"type": "object"}

  def __init__(self, seconds: float):
    self.seconds = seconds

  def __call__(self, text: str = "") -> str:
    time.sleep(self.seconds)
    return f"ok {len(text)}"


class ToolEnv:
  """Every turn calls the sleeping tool; the episode ends after ``turns`` turns."""

  def __init__(self, seconds: float, turns: int):
    self.tools, self.turns = (SleepTool(seconds),), turns

  def reset(self, example, seed):
    self.k, self.seed = 0, seed
    return [Message("user", example["q"])]

  def step(self, action):
    self.k += 1
    out = self.tools[0](text=action)
    return StepResult((Message("tool", out, name="sleep"),), reward=float(len(action) % 2),
                      done=self.k >= self.turns, info={"tool_calls": 1})


def run(args) -> dict:
  cfg = models.ModelConfig(vocab_size=TOK.vocab_size, hidden_size=args.width,
                           intermediate_size=2 * args.width, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=args.width // 4,
                           max_position_embeddings=512, dtype="float32", param_dtype="float32")
  params = models.init_params(cfg, jax.random.key(0), std=0.2)
  stop = [TOK.eos_id] + TOK.encode("aeiou.!?0123")  # turn lengths spread over the budget
  specs = [rollout.EpisodeSpec(lambda: ToolEnv(args.sleep, args.turns), {"q": f"task {i}"})
           for i in range(args.groups)]
  engines = {}
  for name in ("continuous", "lockstep", "turn_sync"):
    engines[name] = rollout.AgentEngine(
        cfg, ChatRenderer(), TOK.decode, n=args.n, max_slots=args.slots, max_prompt_len=32,
        max_total_tokens=args.turns * (args.turn_tokens + 24), max_turn_tokens=args.turn_tokens,
        max_turns=args.turns, max_obs_tokens=24, stop_ids=stop, seed=1,
        ttl=args.ttl if name == "continuous" and args.ttl >= 0 else None,
        workers=args.groups * args.n,
        schedule="turn_sync" if name == "turn_sync" else "continuous",
        deterministic=name == "lockstep")
  for e in engines.values():
    e.warmup(params)  # every shape compiled up front: no compile inside the timed calls
  outs = {s: e.rollout(params, specs) for s, e in engines.items()}  # warm-up call
  times = {s: [] for s in engines}
  for _ in range(args.repeats):
    for s, e in engines.items():
      outs[s] = e.rollout(params, specs)
      times[s].append(outs[s].stats["seconds"])
  a = outs["continuous"]
  for b in (outs["lockstep"], outs["turn_sync"]):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.actions == b.actions
  trajs = args.groups * args.n
  rate = {s: trajs / min(t) for s, t in times.items()}
  return dict(rate=rate, speedup=rate["continuous"] / rate["turn_sync"],
              lockstep=rate["lockstep"] / rate["turn_sync"],
              hit=a.stats["kv_hit_rate"], evictions=a.stats["evictions"],
              turns=float(a.num_turns.mean()), model_tokens=int(a.model_mask.sum()))


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--groups", type=int, default=16)
  p.add_argument("--n", type=int, default=4, help="samples per episode")
  p.add_argument("--slots", type=int, default=4)
  p.add_argument("--turns", type=int, default=3)
  p.add_argument("--turn-tokens", type=int, default=16)
  p.add_argument("--sleep", type=float, default=0.05, help="seconds per tool call")
  p.add_argument("--ttl", type=float, default=0.0,
                 help="KV time-to-live (s) of the continuous schedule; < 0: never evict")
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args(argv)
  r = run(args)
  print("| groups x n | slots | turns | tool sleep | continuous traj/s | lockstep traj/s "
        "| turn-sync traj/s | speed-up (continuous / lockstep) | KV hit rate | evictions |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  print(f"| {args.groups} x {args.n} | {args.slots} | {r['turns']:.1f} | "
        f"{args.sleep * 1e3:.0f} ms | {r['rate']['continuous']:.1f} | "
        f"{r['rate']['lockstep']:.1f} | {r['rate']['turn_sync']:.1f} | "
        f"**{r['speedup']:.2f}x** / {r['lockstep']:.2f}x | {r['hit']:.2f} | "
        f"{r['evictions']} |")
  return r


if __name__ == "__main__":
  main()
