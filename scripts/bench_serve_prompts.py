"""The server's two prompt layouts, alternating: KV memory and time for the same requests.

``rl_jax.serve.scheduler.Scheduler`` keeps a choice's prompt either in its slot's prompt
cache (the default: ``max_prompt_tokens`` positions per slot, whatever the prompt's length,
read in place by the decode) or, with ``prompt_pages`` (``--prompt-pages``), on pages of the
response pool after its first id, so a choice holds pages for its own prompt and output
only. Both give the same choices for the same seeds, with log-probs equal to float rounding
(``tests/test_serve.py``); the script prints whether every layout's ids were the same.

Each round submits the same requests to one scheduler of each layout in turn (lockstep, so
a noisy host slows both alike): prompts of random lengths, one choice each, sampled at
temperature 1 with a seed per request. Printed per layout: the median seconds per round,
output tokens per second, and the KV memory the lane's engine holds: the slots' prompt
caches plus the response pool as allocated (a growing pool doubles as the choices need
it), and the most pool pages in use when a decode call returned.

With ``--choices n`` every request asks for n choices, and with ``--shared-prefix N`` every
prompt begins with the same N tokens (a system prompt); then a third scheduler keeps prompts
on pages without sharing them (``share_prompts=False``): each choice prefills and holds its
own copy of its prompt, where the default takes the whole pages of another choice's prompt
that its own begins with. With ``--prefix-cache N`` the ended choices' pages stay in the
prompt-pages schedulers' prefix cache (``Scheduler(prefix_cache=N)``), so every round after
the first finds its prompts there: the case of a client that sends one prompt again.

    python scripts/bench_serve_prompts.py --rounds 5
    python scripts/bench_serve_prompts.py --rounds 5 --choices 4 --requests 4
    python scripts/bench_serve_prompts.py --rounds 5 --shared-prefix 256 --min-prompt 300
    python scripts/bench_serve_prompts.py --rounds 5 --prefix-cache 64 --choices 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import jax
import numpy as np

from rl_jax import models
from rl_jax.data.tokenizers import CharTokenizer, save_tokenizer
from rl_jax.rollout import kv_cache
from rl_jax.serve.checkpoint import load_served
from rl_jax.serve.scheduler import Request, Sampling, Scheduler

SAMPLING = Sampling(temperature=1.0)


def write_model(hidden: int, layers: int, context: int) -> str:
  """A random character-level Llama saved as a checkpoint directory."""
  tok = CharTokenizer()
  cfg = models.ModelConfig(vocab_size=tok.vocab_size, hidden_size=hidden,
                           intermediate_size=hidden * 11 // 4, num_layers=layers,
                           num_heads=hidden // 64, num_kv_heads=max(1, hidden // 128),
                           head_dim=64, max_position_embeddings=context, dtype="float32",
                           param_dtype="float32")
  d = tempfile.mkdtemp(prefix="bench_serve_prompts_")
  models.save_hf(cfg, models.init_params(cfg, jax.random.key(0), std=0.02), d)
  save_tokenizer("char", d)
  return d


def one_round(sched: Scheduler, prompts: list[list[int]], max_tokens: int,
              choices: int = 1) -> tuple[float, list[list[int]]]:
  """(seconds, every choice's output ids) of the requests (``choices`` each) submitted at
  once, waited for together."""
  reqs = [Request(p, choices, max_tokens, SAMPLING, seed=i) for i, p in enumerate(prompts)]
  start = time.perf_counter()
  for r in reqs:
    sched.submit(r)
  for r in reqs:
    r.done.wait(600)
  return time.perf_counter() - start, [c.ids for r in reqs for c in r.result()]


def kv_memory(sched: Scheduler) -> dict[str, float]:
  """The lane's KV memory: prompt caches and the pool as allocated (MiB), peak pages used."""
  loop = sched._lanes[SAMPLING].loop  # pylint: disable=protected-access
  st, e = loop.state, loop.e
  prompts = sum(x.nbytes for x in st.prefix_k + st.prefix_v)
  pool = kv_cache.pool_bytes(e.cfg, int(st.refs.size), e.S)
  return {"prompt_cache_mib": prompts / 2**20, "pool_mib": pool / 2**20,
          "kv_mib": (prompts + pool) / 2**20, "peak_pages": max(loop.used),
          "page_mib": kv_cache.pool_bytes(e.cfg, 1, e.S) / 2**20}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rounds", type=int, default=5)
  ap.add_argument("--requests", type=int, default=16)
  ap.add_argument("--slots", type=int, default=8)
  ap.add_argument("--min-prompt", type=int, default=50)
  ap.add_argument("--max-prompt", type=int, default=400)
  ap.add_argument("--max-prompt-tokens", type=int, default=512, help="the server's limit")
  ap.add_argument("--max-tokens", type=int, default=64)
  ap.add_argument("--choices", type=int, default=1, help="n of every request")
  ap.add_argument("--prefix-cache", type=int, default=0,
                  help="the schedulers' prefix cache (entries; 0: none, so every round "
                       "prefills its prompts as the first did)")
  ap.add_argument("--shared-prefix", type=int, default=0,
                  help="every prompt begins with these many tokens in common (a system "
                       "prompt), counted in its length")
  ap.add_argument("--page-size", type=int, default=64)
  ap.add_argument("--hidden", type=int, default=256)
  ap.add_argument("--layers", type=int, default=4)
  args = ap.parse_args()
  model = load_served(write_model(args.hidden, args.layers, 2048))
  rng = np.random.default_rng(0)
  lengths = rng.integers(args.min_prompt, args.max_prompt + 1, args.requests)
  common = rng.integers(3, 90, args.shared_prefix).tolist()
  prompts = [common + rng.integers(3, 90, max(int(n) - len(common), 1)).tolist()
             for n in lengths]
  lengths = np.array([len(p) for p in prompts])
  layouts = {"slot": (False, True), "pages": (True, True)}
  if args.choices > 1 or args.shared_prefix:
    layouts["unshared"] = (True, False)
  scheds = {name: Scheduler(model, max_slots=args.slots, max_prompt_tokens=args.max_prompt_tokens,
                            max_tokens=args.max_tokens, page_size=args.page_size,
                            prompt_pages=on, share_prompts=share,
                            prefix_cache=args.prefix_cache)
            for name, (on, share) in layouts.items()}
  print(f"{os.cpu_count()} cores; d={args.hidden}, {args.layers} layers; {args.requests} "
        f"requests, prompts {lengths.min()}-{lengths.max()} tokens (mean {lengths.mean():.0f}), "
        f"{args.shared_prefix} tokens in common, {args.choices} choice(s) each, "
        f"{args.max_tokens} new tokens, {args.slots} slots, --max-prompt-tokens "
        f"{args.max_prompt_tokens}, pages of {args.page_size}", flush=True)
  try:
    for sched in scheds.values():
      one_round(sched, prompts, args.max_tokens, args.choices)  # compiles
    times: dict[str, list[float]] = {name: [] for name in scheds}
    ids = {}
    for _ in range(args.rounds):
      for name, sched in scheds.items():
        seconds, ids[name] = one_round(sched, prompts, args.max_tokens, args.choices)
        times[name].append(seconds)
    tokens = {name: sum(len(x) for x in out) for name, out in ids.items()}
    for name, sched in scheds.items():
      med = float(np.median(times[name]))
      mem = kv_memory(sched)
      print(f"{name:8s}: {med:.3f} s a round (rounds {', '.join(f'{t:.2f}' for t in times[name])})"
            f", {tokens[name] / med:,.0f} output tokens/s; KV {mem['kv_mib']:.1f} MiB (prompt "
            f"caches {mem['prompt_cache_mib']:.1f}, pool {mem['pool_mib']:.1f} allocated), "
            f"peak {mem['peak_pages']} pages of {mem['page_mib']:.2f} MiB in use", flush=True)
    same = all(out == ids["slot"] for out in ids.values())
    print(f"every layout's choices the same ids: {same}", flush=True)
    ratio = np.median(times["pages"]) / np.median(times["slot"])
    print(f"pages / slot time: {ratio:.2f}x", flush=True)
    if "unshared" in times:
      ratio = np.median(times["unshared"]) / np.median(times["pages"])
      print(f"unshared / pages time: {ratio:.2f}x", flush=True)
  finally:
    for sched in scheds.values():
      sched.close()


if __name__ == "__main__":
  main()
