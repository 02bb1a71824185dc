"""Multi-turn rollouts: continuous batching across turns vs a turn-synchronous baseline.

Every environment step calls a tool that sleeps ``--sleep`` seconds (50 ms by default).
The schedules run on the same ``AgentEngine`` (same slots, model, episodes and device
programs); ``schedule="turn_sync"`` makes every sample wait for the slowest tool call of its
turn before all continue together, while ``continuous`` keeps decoding the other samples
while tools run, and with a KV time-to-live (``--ttl``) lends the slot of a group whose
samples all wait on tools to waiting work (Continuum); ``delay D`` is continuous batching
with the deterministic schedule (``AgentEngine(deterministic=True, result_delay=D)``: a
tool's result joins the batch D decode steps after its call, the loop waiting only if the
tool is later, so every decode batch is a function of the seeds; the trainer's schedule),
one column per ``--delays`` value, with the same time-to-live in decode steps
(``--ttl-steps``).
They are timed in interleaved repeats after a warm-up call each (compiles excluded) and
must return identical trajectories (the environments are deterministic).

Usage::

    python scripts/bench_agent.py                     # about a minute on 2 CPU cores
    python scripts/bench_agent.py --groups 32 --repeats 5
    python scripts/bench_agent.py --delays 8,32,128 --ttl-steps 0

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
  delays = [int(d) for d in args.delays.split(",") if d]
  for name in ("continuous", *(f"delay {d}" for d in delays), "turn_sync"):
    det = name.startswith("delay")
    engines[name] = rollout.AgentEngine(
        cfg, ChatRenderer(), TOK.decode, n=args.n, max_slots=args.slots, max_prompt_len=32,
        max_total_tokens=args.turns * (args.turn_tokens + 24), max_turn_tokens=args.turn_tokens,
        max_turns=args.turns, max_obs_tokens=24, stop_ids=stop, seed=1,
        ttl=args.ttl if name == "continuous" and args.ttl >= 0 else None,
        workers=args.groups * args.n,
        schedule="turn_sync" if name == "turn_sync" else "continuous", deterministic=det,
        **(dict(result_delay=int(name.split()[1]),
                ttl_steps=args.ttl_steps if args.ttl_steps >= 0 else None) if det else {}))
  for e in engines.values():
    e.warmup(params)  # every shape compiled up front: no compile inside the timed calls
  outs = {s: e.rollout(params, specs) for s, e in engines.items()}  # warm-up call
  times = {s: [] for s in engines}
  for _ in range(args.repeats):
    for s, e in engines.items():
      outs[s] = e.rollout(params, specs)
      times[s].append(outs[s].stats["seconds"])
  a = outs["continuous"]
  for b in outs.values():
    np.testing.assert_array_equal(a.tokens, b.tokens)
    assert a.actions == b.actions
  trajs = args.groups * args.n
  rate = {s: trajs / min(t) for s, t in times.items()}
  return dict(rate=rate, speedup=rate["continuous"] / rate["turn_sync"],
              hit={s: o.stats["kv_hit_rate"] for s, o in outs.items()},
              evictions={s: o.stats["evictions"] for s, o in outs.items()},
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
  p.add_argument("--delays", default="8,32,128",
                 help="comma-separated result delays (decode steps) of deterministic columns")
  p.add_argument("--ttl-steps", type=int, default=-1,
                 help="KV time-to-live (decode steps) of the deterministic columns; < 0: never")
  p.add_argument("--width", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  args = p.parse_args(argv)
  r = run(args)
  names = list(r["rate"])
  print("| groups x n | slots | turns | tool sleep | "
        + " | ".join(f"{s} traj/s (hit rate, evictions)" for s in names)
        + " | speed-up (continuous / turn-sync) |")
  print("|---|---|---|---|" + "---|" * (len(names) + 1))
  print(f"| {args.groups} x {args.n} | {args.slots} | {r['turns']:.1f} | "
        f"{args.sleep * 1e3:.0f} ms | "
        + " | ".join(f"{r['rate'][s]:.1f} ({r['hit'][s]:.2f}, {r['evictions'][s]})"
                     for s in names) + f" | **{r['speedup']:.2f}x** |")
  return r


if __name__ == "__main__":
  main()
