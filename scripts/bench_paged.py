"""Does a rollout's cost follow the tokens generated or its ``max_new_tokens`` budget?

The same 64 samples (8 prompts x 8 samples of a random 4-layer Llama-style model, temperature
1, an EOS id, so every sample ends long before its budget) are generated with
``max_new_tokens`` = 512 and = 8192, each in its own fresh process (its peak resident memory
is the process's ``ru_maxrss``), the processes alternating round by round. Three settings:

* ``paged 512`` / ``paged 8192``: the paged response cache at its defaults (``page_size``
  64, the pool grown as responses need it); the 8192 / 512 ratios are the claim.
* ``slot 8192``: one page per sample (``page_size`` >= the budget): every sample holds a
  worst-case slot and every decode step reads all of it (the former layout; the baseline).

Each child times ``generate`` after one untimed call (compile excluded) and prints the
tokens' hash, so the three settings are checked to draw identical tokens. The children run
on the CPU unless ``--accelerator`` is given: then on JAX's default backend (a GPU or TPU),
and each also reports its device's peak bytes in use (``memory_stats``).

``--fixed-budget``: one memory budget for the K/V of responses, 8 x 8192 tokens, spent as
8 worst-case slots of 8192 tokens (``page_size`` 8192, ``kv_pages`` 8: one group of 8
samples at a time) or as 1024 pages of 64 tokens (as many samples in flight as their tokens
fit; when the pool runs out the newest group is preempted and later resumed by recompute).
Long-tailed lengths: a random model over 512 token ids with EOS one of them (geometric
lengths, mean about 500), a budget of 8192 new tokens; 4 prompts x 8 samples. Generated
tokens per second of the two, same tokens.

``--bandwidth``: decode against the memory-bandwidth limit at a size where weights dominate
(d = 1024, 4 layers, batch 16, greedy, no EOS): the time per decode step (slope between 64
and 192 new tokens, which removes prefill) against the bytes a step must read (weights +
the live K/V: the pages of the live bucket and the prompt caches), as a fraction of this
host's copy bandwidth measured in the same run (a 256 MiB numpy copy, read + write).

``--fork``: n continuations of one mid-sequence state (``generate(prefixes=)``: 8 prompts,
each with a 1024-token response prefix, 8 samples continuing it for up to 64 tokens, no
EOS): the prefix prefilled once and forked by the other samples (whole pages shared, the
partial last page copied) against every sample prefilling it (``share_prefixes=False``),
calls alternating; time and peak pages, same tokens.

``--prompts``: the prompt on pool pages (``prompt_pages``: its ids after the first written
once per group and forked by the group's other samples) against the prompt in each slot's
own cache (``max_prompt_len`` positions per slot whatever the prompt's length): 8 prompts of
long-tailed lengths (32 to 2048 tokens), 8 samples each, up to 128 new tokens (``--new``: 2
leaves mostly the prefill), pages of 64, calls alternating; time, the K/V bytes held (prompt
caches + the pool as allocated) and peak pages, same tokens.

``--agent``: the same two layouts for multi-turn episodes (``AgentEngine(prompt_pages=)``,
the deterministic schedule): 16 episodes x 4 samples whose first prompts are one system
prompt of 1024 tokens (a tool documentation's stand-in) and a task of 8-64, three turns of
up to 32 tokens, 8 slots, pages of 64, calls alternating; time and the K/V in use at the peak
(the slots' prompt caches and the pool's pages), same trajectories.

``--agent-budget``: does a multi-turn rollout's cost follow its trajectories or its budget?
16 episodes x 4 samples (a 32-character system prompt, three turns of up to 32 tokens, 8
slots, pages of 64, the deterministic schedule) at ``max_total_tokens`` 512 and 8192, each
in its own fresh process, alternating; time, peak resident memory, same trajectories.

Usage::

    python scripts/bench_paged.py --rounds 3       # about 5 minutes on 2 CPU cores
    python scripts/bench_paged.py --rounds 1 --accelerator   # on a GPU / TPU host
    python scripts/bench_paged.py --fork --repeats 3
    python scripts/bench_paged.py --fixed-budget --repeats 1   # about 20 minutes
    python scripts/bench_paged.py --bandwidth
    python scripts/bench_paged.py --prompts --repeats 3
    python scripts/bench_paged.py --prompts --new 2 --repeats 3   # the prefill's share
    python scripts/bench_paged.py --agent --repeats 3   # about 8 minutes
    python scripts/bench_paged.py --agent-budget --rounds 2 --repeats 2

Reference: Kwon et al. 2023, "Efficient Memory Management for Large Language Model Serving
with PagedAttention".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SETTINGS = {"paged 512": (512, 64), "paged 8192": (8192, 64), "slot 8192": (8192, 8192)}


def _workload(vocab: int, context: int, prompts: int):
  """A random 4-layer d=128 model over ``vocab`` token ids (EOS is id 0, so lengths are
  geometric with mean about ``vocab``) and ``prompts`` prompts of 8-16 random ids."""
  import jax
  import numpy as np

  from rl_jax import models
  from rl_jax.models.config import ModelConfig

  cfg = ModelConfig(vocab_size=vocab, hidden_size=128, intermediate_size=352, num_layers=4,
                    num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=context,
                    dtype="float32", param_dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  rng = np.random.default_rng(0)
  return cfg, params, [rng.integers(1, vocab, size=int(rng.integers(8, 17))).tolist()
                       for _ in range(prompts)]


def child(max_new: int, page_size: int, repeats: int) -> dict:
  """One setting in this process: best time of ``repeats`` generate calls after a warm-up."""
  import numpy as np

  from rl_jax import rollout

  cfg, params, prompts = _workload(64, 16384, 8)
  run = lambda: rollout.generate(cfg, params, prompts, n=8, max_new_tokens=max_new,
                                 temperature=1.0, eos_id=0, seed=1, page_size=page_size)
  out = run()
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    out = run()
    best = min(best, time.perf_counter() - t)
  toks = np.where(out.mask, out.tokens, -1)[:, :int(out.lengths.max())]
  import jax  # pylint: disable=import-outside-toplevel
  stats = jax.devices()[0].memory_stats() or {}
  return dict(seconds=best, rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              device=jax.devices()[0].device_kind,
              device_peak_mib=stats.get("peak_bytes_in_use", 0) / 2**20,
              tokens_sha=hashlib.sha256(np.ascontiguousarray(toks).tobytes()).hexdigest()[:16],
              mean_len=float(out.lengths.mean()), max_len=int(out.lengths.max()),
              peak_pages=out.stats["kv_pages_used_peak"], kv_bytes=int(out.stats["kv_bytes"]),
              decode_buckets=out.stats["decode_buckets"])


def fixed_budget(repeats: int) -> None:
  """Tokens/s of 32 long-tailed samples in one K/V budget: worst-case slots vs pages."""
  import numpy as np

  from rl_jax import rollout

  cfg, params, prompts = _workload(512, 8400, 4)
  settings = {"slots of 8192 (8 pages)": (8192, 8), "pages of 64 (1024 pages)": (64, 1024)}
  runs = {}
  for name, (page, pool) in settings.items():
    run = lambda: rollout.generate(cfg, params, prompts, n=8, max_new_tokens=8192,
                                   temperature=1.0, eos_id=0, seed=1, page_size=page,
                                   kv_pages=pool)
    t = time.perf_counter()
    out = run()  # compiles every bucket it meets
    best = time.perf_counter() - t  # the first call's time, compiles included, if no repeats
    for _ in range(repeats):
      t = time.perf_counter()
      out = run()
      best = min(best, time.perf_counter() - t)
    runs[name] = (best, out)
    print(f"{name}: {best:.2f} s, {int(out.mask.sum())} tokens, {out.mask.sum() / best:.0f} "
          f"tokens/s, preemptions {out.stats['preemptions']:.0f}, peak pages "
          f"{out.stats['kv_pages_used_peak']:.0f}", flush=True)
  (ts, slot), (tp, paged) = runs.values()
  print(f"lengths: mean {slot.lengths.mean():.0f}, median {np.median(slot.lengths):.0f}, "
        f"max {slot.lengths.max()}; tokens identical: "
        f"{np.array_equal(slot.tokens, paged.tokens)}; pages / slots tokens/s: {ts / tp:.2f}x")


def bandwidth(repeats: int) -> None:
  """Decode step time against the bytes it must read, vs the host's copy bandwidth."""
  import jax
  import numpy as np

  from rl_jax import models, rollout
  from rl_jax.models.config import ModelConfig
  from rl_jax.rollout import kv_cache, pages

  cfg = ModelConfig(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_layers=4,
                    num_heads=16, num_kv_heads=4, head_dim=64, max_position_embeddings=1024,
                    dtype="float32", param_dtype="float32")
  params = models.init_params(cfg, jax.random.key(0))
  B, P = 16, 32
  prompts = np.random.default_rng(3).integers(1, 512, (B, P)).tolist()
  times = {}
  for T in (64, 192):
    run = lambda: rollout.generate(cfg, params, prompts, max_new_tokens=T, temperature=0.0)
    run()
    times[T] = min(_timed(run) for _ in range(repeats))
  step_s = (times[192] - times[64]) / 128
  weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
  # live K/V per step: the live bucket's pages (128 then 256 tokens over the slope) of every
  # sample, and the prompt caches (bucket 32)
  live = np.mean([pages.live_bucket(t, 64, 4) * 64 for t in range(65, 193)])
  kv = kv_cache.pool_bytes(cfg, 1, 1) * (B * live + B * P)
  src = np.ones((256 << 20) // 4, np.float32)
  dst = np.empty_like(src)
  copy = min(_timed(lambda: np.copyto(dst, src)) for _ in range(5))
  peak = 2 * src.nbytes / copy
  achieved = (weights + kv) / step_s
  print(f"d=1024, batch {B}: {step_s * 1e3:.2f} ms/step; reads weights {weights / 2**20:.1f} "
        f"MiB + live K/V {kv / 2**20:.1f} MiB -> {achieved / 1e9:.2f} GB/s; numpy copy "
        f"{peak / 1e9:.2f} GB/s: {achieved / peak:.1%} of the copy bandwidth")


def fork(repeats: int) -> None:
  """n continuations of a long response prefix: forked vs each sample prefilling it."""
  import numpy as np

  from rl_jax import rollout

  cfg, params, prompts = _workload(512, 2048, 8)
  heads = np.random.default_rng(2).integers(1, 512, (8, 1024)).tolist()
  outs, times = {}, {True: [], False: []}
  for share in (True, False, True, False) + (True, False) * repeats:
    t = time.perf_counter()
    outs[share] = rollout.generate(cfg, params, prompts, n=8, max_new_tokens=1088,
                                   temperature=1.0, seed=1, prefixes=heads,
                                   share_prefixes=share)
    times[share].append(time.perf_counter() - t)
  a, b = outs[True], outs[False]
  same = np.array_equal(a.tokens, b.tokens) and np.allclose(a.logprobs, b.logprobs, atol=1e-5)
  best = {k: min(v[2:]) for k, v in times.items()}  # the first two calls compile
  print(f"forked: {best[True]:.2f} s, peak pages {a.stats['kv_pages_used_peak']:.0f}, "
        f"{a.stats['forked_samples']:.0f} samples forked; prefilled by each: {best[False]:.2f} "
        f"s, peak pages {b.stats['kv_pages_used_peak']:.0f}; time {best[False] / best[True]:.2f}x, "
        f"pages {b.stats['kv_pages_used_peak'] / a.stats['kv_pages_used_peak']:.2f}x; same "
        f"tokens and log-probs: {same}")


def _in_use_mib(cfg, out, prompt_positions: int) -> float:
  """MiB of K/V in use at a rollout's peak: 8 slots' prompt caches of ``prompt_positions``
  each and the pool's pages of 64 tokens in use (``out.stats["kv_pages_used_peak"]``)."""
  from rl_jax.rollout import kv_cache

  per_token = kv_cache.pool_bytes(cfg, 1, 1)
  return per_token * (8 * prompt_positions + 64 * int(out.stats["kv_pages_used_peak"])) / 2**20


def prompts_on_pages(repeats: int, new: int = 128) -> None:
  """The trainer's prompts on pool pages vs in each slot's prompt cache."""
  import numpy as np

  from rl_jax import rollout

  cfg, params, _ = _workload(512, 4096, 0)
  rng = np.random.default_rng(4)
  lengths = np.minimum(32 * 2 ** rng.exponential(1.6, 8), 2048).astype(int)
  prompts = [rng.integers(1, 512, size=int(n)).tolist() for n in lengths]
  outs, times = {}, {False: [], True: []}
  for on in (False, True, False, True) + (False, True) * repeats:
    t = time.perf_counter()
    outs[on] = rollout.generate(cfg, params, prompts, n=8, max_new_tokens=new, temperature=1.0,
                                eos_id=0, seed=1, page_size=64, prompt_pages=on)
    times[on].append(time.perf_counter() - t)
  a, b = outs[False], outs[True]
  same = np.array_equal(a.tokens, b.tokens) and np.allclose(a.logprobs, b.logprobs, atol=1e-5)
  best = {k: min(v[2:]) for k, v in times.items()}  # the first two calls compile
  mib = lambda out: out.stats["kv_bytes"] / 2**20
  # the slots' prompt caches: 2048 positions, or the first id's bucket of 8
  used = {on: _in_use_mib(cfg, out, 8 if on else 2048) for on, out in outs.items()}
  print(f"prompts of {lengths.min()}-{lengths.max()} tokens (mean {lengths.mean():.0f}), 8 "
        f"samples each, mean response {a.lengths.mean():.0f} tokens")
  print(f"prompt in the slot: {best[False]:.2f} s, K/V in use at the peak {used[False]:.1f} MiB "
        f"({a.stats['kv_pages_used_peak']:.0f} pages), allocated {mib(a):.1f} MiB; prompt on "
        f"pages: {best[True]:.2f} s ({best[True] / best[False]:.2f}x), K/V in use at the peak "
        f"{used[True]:.1f} MiB ({used[True] / used[False]:.2f}x; "
        f"{b.stats['kv_pages_used_peak']:.0f} pages), allocated {mib(b):.1f} MiB "
        f"({mib(b) / mib(a):.2f}x), prompt pages shared {b.stats['prefix_pages_shared']:.0f}; "
        f"same tokens and log-probs: {same}")


def _episodes(system: int, context: int = 4096):
  """Multi-turn episodes of a character-level renderer: 16 episodes whose first prompts are
  one system prompt of ``system`` characters and a task of 4-60, three turns, each
  observation reporting the action's length. Returns (cfg, params, tokenizer, renderer,
  specs, stop ids, the longest first prompt)."""
  import numpy as np

  from rl_jax import rollout
  from rl_jax.data.tokenizers import CharTokenizer
  from rl_jax.envs import Message, StepResult

  tok = CharTokenizer()
  cfg, params, _ = _workload(tok.vocab_size, context, 0)
  rng = np.random.default_rng(5)
  text = "".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz ,."), system))  # the tools' docs

  class Renderer:
    end_of_turn_ids = [tok.eos_id]

    def prompt_ids(self, messages, tools=()):
      return tok.encode("".join(f"{m.role[0]}:{m.content}\n" for m in messages) + "a:")

    def delta_ids(self, history, new):
      return tok.encode("\n" + "".join(f"{m.role[0]}:{m.content}\n" for m in new) + "a:")

  class Env:  # three turns; each observation reports the action's length
    tools = ()

    def reset(self, example, seed):
      self.k = 0
      return [Message("system", text), Message("user", example["q"])]

    def step(self, action):
      self.k += 1
      return StepResult((Message("tool", f"got {len(action)}"),), reward=0.0,
                        done=self.k >= 3)

  specs = [rollout.EpisodeSpec(Env, {"q": f"task {i}: " + "x" * int(rng.integers(4, 60))})
           for i in range(16)]
  stop = [tok.eos_id] + tok.encode("aeiou.")
  return cfg, params, tok, Renderer(), specs, stop, system + 96


def agent_prompts(repeats: int, system: int = 1024) -> None:
  """Multi-turn episodes opening with one long system prompt: the first prompt on pool pages
  vs in each slot's own cache."""
  import numpy as np

  from rl_jax import rollout

  cfg, params, tok, renderer, specs, stop, P = _episodes(system)
  make = lambda on: rollout.AgentEngine(
      cfg, renderer, tok.decode, n=4, max_slots=8, max_prompt_len=P, max_total_tokens=192,
      max_turn_tokens=32, max_turns=3, max_obs_tokens=16, stop_ids=stop, seed=1,
      deterministic=True, result_delay=4, page_size=64, prompt_pages=on)
  engines = {on: make(on) for on in (False, True)}
  outs, times = {}, {False: [], True: []}
  for on in (False, True, False, True) + (False, True) * repeats:
    t = time.perf_counter()
    outs[on] = engines[on].rollout(params, specs)
    times[on].append(time.perf_counter() - t)
  for e in engines.values():
    e.close()
  a, b = outs[False], outs[True]
  same = (np.array_equal(a.tokens, b.tokens) and a.actions == b.actions
          and np.allclose(a.logprobs, b.logprobs, atol=1e-5))
  best = {k: min(v[2:]) for k, v in times.items()}  # the first two calls compile
  # the slots' prompt caches: P rounded up to a power of two, or the first id's bucket of 8
  used = {on: _in_use_mib(cfg, out, 8 if on else engines[False].P)
          for on, out in outs.items()}
  print(f"16 episodes x 4 samples, first prompts of {system} + 8-64 tokens, "
        f"{a.num_turns.mean():.1f} turns, {a.lengths.mean():.0f} trajectory tokens a sample")
  print(f"prompt in the slot: {best[False]:.2f} s, K/V in use at the peak {used[False]:.1f} MiB "
        f"({a.stats['kv_pages_used_peak']:.0f} pages); prompt on pages: {best[True]:.2f} s "
        f"({best[True] / best[False]:.2f}x), K/V in use at the peak {used[True]:.1f} MiB "
        f"({used[True] / used[False]:.2f}x; {b.stats['kv_pages_used_peak']:.0f} pages), "
        f"{b.stats['forked_samples']:.0f} samples forked; same trajectories: {same}")


AGENT_BUDGETS = (512, 8192)


def agent_budget_child(budget: int, repeats: int) -> dict:
  """One multi-turn budget in this process: best time of ``repeats`` rollouts of 16 episodes
  x 4 samples (three turns of up to 32 tokens, a short system prompt) after a warm-up."""
  import numpy as np

  from rl_jax import rollout

  cfg, params, tok, renderer, specs, stop, P = _episodes(32, context=16384)
  engine = rollout.AgentEngine(
      cfg, renderer, tok.decode, n=4, max_slots=8, max_prompt_len=P, max_total_tokens=budget,
      max_turn_tokens=32, max_turns=3, max_obs_tokens=16, stop_ids=stop, seed=1,
      deterministic=True, result_delay=4, page_size=64)
  out = engine.rollout(params, specs)
  best = float("inf")
  for _ in range(repeats):
    t = time.perf_counter()
    out = engine.rollout(params, specs)
    best = min(best, time.perf_counter() - t)
  engine.close()
  n = int(out.lengths.max())
  toks = np.where(np.arange(out.tokens.shape[1])[None, :n] < out.lengths[:, None],
                  out.tokens[:, :n], -1)
  return dict(seconds=best, rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
              tokens_sha=hashlib.sha256(np.ascontiguousarray(toks).tobytes()).hexdigest()[:16],
              mean_len=float(out.lengths.mean()), max_len=n,
              peak_pages=out.stats["kv_pages_used_peak"])


def agent_budget(rounds: int, repeats: int) -> None:
  """The multi-turn rollout's cost at ``max_total_tokens`` 8192 vs 512, same trajectories:
  each budget in its own fresh process, alternating."""
  runs = _in_fresh_processes(
      {b: ["--agent-child", str(b), "--repeats", str(repeats)] for b in AGENT_BUDGETS}, rounds,
      dict(os.environ, JAX_PLATFORMS="cpu"))
  med = lambda b, k: sorted(x[k] for x in runs[b])[len(runs[b]) // 2]
  first = runs[AGENT_BUDGETS[0]][0]
  same = len({x["tokens_sha"] for v in runs.values() for x in v}) == 1
  print(f"\n16 episodes x 4 samples, {first['mean_len']:.0f} trajectory tokens a sample "
        f"(longest {first['max_len']}); trajectories identical across budgets: {same}")
  print("| max_total_tokens | time (s) | peak RSS (MiB) | peak pages |\n|---|---|---|---|")
  for b in AGENT_BUDGETS:
    print(f"| {b} | {med(b, 'seconds'):.3f} | {med(b, 'rss_mib'):.0f} | "
          f"{med(b, 'peak_pages'):.0f} |")
  lo, hi = AGENT_BUDGETS
  print(f"{hi} / {lo}: time {med(hi, 'seconds') / med(lo, 'seconds'):.2f}x, peak RSS "
        f"{med(hi, 'rss_mib') / med(lo, 'rss_mib'):.2f}x")


def _in_fresh_processes(settings: dict, rounds: int, env: dict) -> dict:
  """Run each setting's child (``settings``: name -> this script's arguments for it) in a
  fresh process, the settings alternating, ``rounds`` times; each name's results (the
  child's "@@" JSON line) in round order."""
  runs = {name: [] for name in settings}
  for r in range(rounds):
    for name, argv in settings.items():
      p = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True,
                         check=False, env=env)
      if p.returncode:
        raise SystemExit(f"{name} exited {p.returncode}:\n{p.stderr[-3000:]}")
      line = next(l for l in p.stdout.splitlines() if l.startswith("@@"))
      runs[name].append(json.loads(line[3:]))
      print(f"round {r} {name}: {runs[name][-1]}", flush=True)
  return runs


def _timed(fn) -> float:
  t = time.perf_counter()
  fn()
  return time.perf_counter() - t


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--rounds", type=int, default=3, help="fresh processes per setting")
  ap.add_argument("--repeats", type=int, default=3,
                  help="timed calls per process (--fixed-budget: after the first call, which "
                  "compiles; 0 times the first)")
  ap.add_argument("--fixed-budget", action="store_true", help="pages vs slots in one budget")
  ap.add_argument("--bandwidth", action="store_true", help="decode vs copy bandwidth")
  ap.add_argument("--fork", action="store_true", help="forked vs re-prefilled prefixes")
  ap.add_argument("--prompts", action="store_true", help="prompts on pages vs in the slot")
  ap.add_argument("--agent", action="store_true",
                  help="multi-turn first prompts on pages vs in the slot")
  ap.add_argument("--agent-budget", action="store_true",
                  help="multi-turn episodes at max_total_tokens 8192 vs 512")
  ap.add_argument("--new", type=int, default=128, help="--prompts: max_new_tokens")
  ap.add_argument("--accelerator", action="store_true",
                  help="run the children on JAX's default backend, not the CPU")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  ap.add_argument("--agent-child", type=int, default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.fixed_budget:
    return fixed_budget(args.repeats)
  if args.bandwidth:
    return bandwidth(args.repeats)
  if args.fork:
    return fork(args.repeats)
  if args.prompts:
    return prompts_on_pages(args.repeats, args.new)
  if args.agent:
    return agent_prompts(args.repeats)
  if args.agent_budget:
    return agent_budget(args.rounds, args.repeats)
  if args.agent_child:
    print("@@", json.dumps(agent_budget_child(args.agent_child, args.repeats)), flush=True)
    return
  if args.child:
    max_new, page = map(int, args.child.split(","))
    print("@@", json.dumps(child(max_new, page, args.repeats)), flush=True)
    return
  env = dict(os.environ) if args.accelerator else dict(os.environ, JAX_PLATFORMS="cpu")
  runs = _in_fresh_processes(
      {name: ["--child", f"{max_new},{page}", "--repeats", str(args.repeats)]
       for name, (max_new, page) in SETTINGS.items()}, args.rounds, env)
  med = lambda name, k: sorted(x[k] for x in runs[name])[len(runs[name]) // 2]
  shas = {x["tokens_sha"] for v in runs.values() for x in v}
  print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"device {runs['paged 512'][0]['device']}; {args.rounds} rounds, best of "
        f"{args.repeats} calls each, medians over rounds")
  first = runs["paged 512"][0]
  print(f"64 samples, mean length {first['mean_len']:.0f}, longest {first['max_len']}; "
        f"tokens identical across settings: {len(shas) == 1}")
  mem = "device_peak_mib" if args.accelerator else "rss_mib"
  label = "peak device MiB" if args.accelerator else "peak RSS (MiB)"
  print(f"| setting | time (s) | {label} | KV bytes held | decode programs |")
  print("|---|---|---|---|---|")
  for name in SETTINGS:
    print(f"| {name} | {med(name, 'seconds'):.3f} | {med(name, mem):.0f} | "
          f"{med(name, 'kv_bytes')} | {med(name, 'decode_buckets'):.0f} |")
  for name in ("paged 8192", "slot 8192"):
    print(f"{name} / paged 512: time {med(name, 'seconds') / med('paged 512', 'seconds'):.2f}x, "
          f"{label} {med(name, mem) / med('paged 512', mem):.2f}x")


if __name__ == "__main__":
  main()
