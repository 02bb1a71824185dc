"""Policy-update step: packed prompt-once (DualKV) layout vs replicated prompts, in one run.

For each (N, P, R) this measures one GRPO-style policy-update step (forward + backward +
optax Adam update, jitted with params and optimizer state donated) in both layouts of
``rl_jax.models.response_logprobs``:

  packed      ``shared_prefix=True``:  one row of P + N·R tokens per group
  replicated  ``shared_prefix=False``: N rows of P + R tokens per group

and prints, next to the token reduction rho = N(P+R)/(P+N·R):
  * the FLOP ratio replicated/packed from XLA's ``cost_analysis()`` (the ceiling),
  * the median step time over interleaved repetitions (A, B, A, B, ...; compile and a
    warm-up step excluded),
  * the compiled executables' ``memory_analysis()``: temp bytes and temp + argument + output.
Before timing, the two layouts' log-probs are checked to agree (max abs diff <= 1e-4).

XLA's cost analysis counts a while-loop body once, whatever its trip count. The FLOP count
therefore comes from the same step compiled with every loop of trip count one (a one-layer
model, one log-prob chunk), where the count is exact. With A the per-step work both layouts
share (LM head on the N·R response tokens, loss, Adam) the L-layer ratio (A + L·B_rep) /
(A + L·B_packed) grows with L, so the one-layer ratio is a lower bound of the timed
two-layer model's ceiling.

On a GPU or TPU backend the script also times the shared-prefix attention kernel
(``backend="auto"``) against its jnp reference and against plain masked attention over the
replicated concatenated sequences (forward + backward); on CPU that part is skipped.

Usage::

    python scripts/bench_shared_prefix.py                       # default run, ~4 min on 2 shared cores
    python scripts/bench_shared_prefix.py --quick               # toy sizes, seconds

References: DualKV shared-prefix attention (amazon-science/dualkv-flash-attn-for-rl).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from rl_jax import models
from rl_jax.models import transformer as tx

import pallas_kernels

DEFAULT_CONFIGS = ((8, 512, 128), (16, 1024, 256))
# Also measured in docs/BENCHMARKS.md; ~3 more minutes and ~12 GB for the replicated
# step: --configs "8,512,128;16,1024,256;16,2048,256".
QUICK_CONFIGS = ((4, 32, 8),)
LOGPROB_TOL = 1e-4
VARIANTS = (("replicated", False), ("packed", True))


# ------------------------------------------------------------------------------ setup
def model_config(quick: bool = False) -> models.ModelConfig:
  """The small decoder both layouts run (a toy one for ``--quick``)."""
  if quick:
    return models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                              num_heads=4, num_kv_heads=2, head_dim=8, logits_chunk=32)
  return models.ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512,
                            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64,
                            max_position_embeddings=4096)


def make_batch(cfg: models.ModelConfig, groups: int, n: int, p: int, r: int,
               seed: int = 0) -> dict:
  """Random GRPO batch: right-padded prompts, N responses per prompt, advantages.

  The first prompt fills all P tokens; the others are 3/4 to all of P. Responses have random
  lengths in [R/2, R] (the mask marks valid tokens).
  """
  rng = np.random.default_rng(seed)
  lengths = rng.integers(max(1, 3 * p // 4), p + 1, groups).astype(np.int32)
  lengths[0] = p
  prompts = rng.integers(1, cfg.vocab_size, (groups, p)).astype(np.int32)
  prompts[np.arange(p)[None, :] >= lengths[:, None]] = 0
  responses = rng.integers(1, cfg.vocab_size, (groups, n, r)).astype(np.int32)
  resp_len = rng.integers(max(1, r // 2), r + 1, (groups, n))
  mask = np.arange(r)[None, None, :] < resp_len[..., None]
  adv = rng.standard_normal((groups, n)).astype(np.float32)
  return {"prompt_tokens": jnp.asarray(prompts), "prompt_lengths": jnp.asarray(lengths),
          "response_tokens": jnp.asarray(responses), "response_mask": jnp.asarray(mask),
          "advantages": jnp.asarray(adv)}


def batch_logprobs(cfg, params, batch, shared_prefix: bool) -> jax.Array:
  """Per-token log-probs [G,N,R] of the batch's responses in one layout."""
  return models.response_logprobs(cfg, params, batch["prompt_tokens"], batch["prompt_lengths"],
                                  batch["response_tokens"], batch["response_mask"],
                                  shared_prefix=shared_prefix)


def grpo_loss(cfg, shared_prefix: bool, params, batch) -> jax.Array:
  """-(adv · logp · mask).sum() / mask.sum(): the on-policy GRPO surrogate."""
  logp = batch_logprobs(cfg, params, batch, shared_prefix)
  mask = batch["response_mask"].astype(jnp.float32)
  adv = batch["advantages"][..., None]
  return -(adv * logp * mask).sum() / mask.sum()


def make_step(cfg, optimizer, shared_prefix: bool):
  """(params, opt_state, batch) -> (params, opt_state, loss): one Adam policy update."""

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(lambda p: grpo_loss(cfg, shared_prefix, p, batch))(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step


def compile_step(cfg, optimizer, shared_prefix: bool, params, opt_state, batch):
  """The step jitted with params and optimizer state donated, lowered and compiled."""
  jitted = jax.jit(make_step(cfg, optimizer, shared_prefix), donate_argnums=(0, 1))
  return jitted.lower(params, opt_state, batch).compile()


# ------------------------------------------------------------------------------ measures
def compiled_flops(compiled) -> float:
  """XLA's FLOP count of a compiled executable (a dict, or a list of one dict)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0]
  return float(cost["flops"])


def compiled_memory(compiled) -> dict:
  """temp bytes and temp + argument + output bytes from ``memory_analysis()`` (donated
  parameters and optimizer state are counted as both argument and output)."""
  mem = compiled.memory_analysis()
  temp = int(mem.temp_size_in_bytes)
  total = temp + int(mem.argument_size_in_bytes) + int(mem.output_size_in_bytes)
  return {"temp": temp, "total": total}


def exact_flops(cfg, optimizer, params, batch) -> dict:
  """FLOPs of both layouts' steps with every loop of trip count one (exact XLA count)."""
  g, n, r = batch["response_tokens"].shape
  one = cfg.replace(num_layers=1, logits_chunk=n * r)
  params = dict(params, layers=jax.tree.map(lambda x: x[:1], params["layers"]))
  opt_state = optimizer.init(params)
  return {name: compiled_flops(compile_step(one, optimizer, sp, params, opt_state, batch))
          for name, sp in VARIANTS}


def max_logprob_diff(cfg, params, batch) -> float:
  """max |packed - replicated| over the batch's log-probs (jitted, not timed)."""
  fn = jax.jit(batch_logprobs, static_argnums=(0, 3))
  packed = fn(cfg, params, batch, True)
  replicated = fn(cfg, params, batch, False)
  return float(jnp.max(jnp.abs(packed - replicated)))


def copy_tree(tree):
  """Fresh buffers for a pytree (donation consumes the ones passed in)."""
  return jax.tree.map(jnp.copy, tree)


def make_runner(compiled, params, opt_state, batch):
  """A closure running one donated step on its own state; returns the loss."""
  state = [params, opt_state]

  def run():
    state[0], state[1], loss = compiled(state[0], state[1], batch)
    return float(jax.block_until_ready(loss))

  return run


def time_interleaved(runners: dict, repeats: int) -> dict:
  """Median wall seconds per runner: one warm-up each, then A, B, A, B, ... ``repeats`` times."""
  for run in runners.values():
    run()
  times = {name: [] for name in runners}
  for _ in range(repeats):
    for name, run in runners.items():
      t0 = time.perf_counter()
      run()
      times[name].append(time.perf_counter() - t0)
  return {name: statistics.median(ts) for name, ts in times.items()}


# ------------------------------------------------------------------------------ one config
def bench_config(cfg, n: int, p: int, r: int, groups: int, repeats: int, seed: int = 0) -> dict:
  """Everything for one (N, P, R): log-prob check, FLOPs, memory, step times."""
  optimizer = optax.adam(1e-4)
  params = jax.jit(models.init_params, static_argnums=0)(cfg, jax.random.key(seed))
  batch = make_batch(cfg, groups, n, p, r, seed)
  diff = max_logprob_diff(cfg, params, batch)
  if not diff <= LOGPROB_TOL:
    raise AssertionError(f"N={n} P={p} R={r}: packed and replicated log-probs differ by {diff:.2e}")
  flops = exact_flops(cfg, optimizer, params, batch)
  runners, memory, compile_s = {}, {}, {}
  for name, sp in VARIANTS:
    own = copy_tree(params)
    opt_state = optimizer.init(own)
    t0 = time.perf_counter()
    compiled = compile_step(cfg, optimizer, sp, own, opt_state, batch)
    compile_s[name] = time.perf_counter() - t0
    memory[name] = compiled_memory(compiled)
    runners[name] = make_runner(compiled, own, opt_state, batch)
  secs = time_interleaved(runners, repeats)
  rho = models.token_reduction(n, p, r)
  speedup = secs["replicated"] / secs["packed"]
  return dict(n=n, p=p, r=r, groups=groups, rho=rho,
              flop_ratio=flops["replicated"] / flops["packed"], flops=flops, diff=diff,
              ms={k: 1e3 * v for k, v in secs.items()}, speedup=speedup,
              speedup_over_rho=speedup / rho, memory=memory, compile_s=compile_s,
              repeats=repeats)


# ------------------------------------------------------------------------------ kernel (GPU/TPU)
def _attention_inputs(groups, n, p, r, heads, kv_heads, head_dim, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 5)
  shapes = ((groups, n, r, heads, head_dim), (groups, p, kv_heads, head_dim),
            (groups, p, kv_heads, head_dim), (groups, n, r, kv_heads, head_dim),
            (groups, n, r, kv_heads, head_dim))
  return tuple(jax.random.normal(k, s, jnp.float32).astype(dtype) for k, s in zip(keys, shapes))


def replicated_attention(q, k_ctx, v_ctx, k_resp, v_resp):
  """Plain causal attention over the N·G replicated [context; response] sequences.

  The context queries are the context keys' rows of q's layout (one per context position,
  repeated for each response), as the replicated layout computes them; returns the response
  rows [G,N,R,H,D].
  """
  g, n, r, h, d = q.shape
  p, kh = k_ctx.shape[1], k_ctx.shape[2]
  rep = lambda x: jnp.repeat(x, n, axis=0)
  q_ctx = jnp.repeat(k_ctx, h // kh, axis=2)  # stand-in prompt queries [G,P,H,D]
  qs = jnp.concatenate([rep(q_ctx), q.reshape(g * n, r, h, d)], axis=1)
  ks = jnp.concatenate([rep(k_ctx), k_resp.reshape(g * n, r, kh, d)], axis=1)
  vs = jnp.concatenate([rep(v_ctx), v_resp.reshape(g * n, r, kh, d)], axis=1)
  pos = jnp.broadcast_to(jnp.arange(p + r), (g * n, p + r))
  out = tx.dense_attention(qs, ks, vs, tx.causal_mask(pos, pos))
  return out[:, p:].reshape(g, n, r, h, d)


def attention_grad_fn(attend):
  """jit of (inputs) -> grads of sum(out · w) in every input, w a fixed random cotangent."""

  def loss(args, w):
    return jnp.sum(attend(*args).astype(jnp.float32) * w)

  return jax.jit(jax.grad(loss))


def bench_kernel(n, p, r, groups=1, heads=4, kv_heads=2, head_dim=64, dtype=jnp.bfloat16,
                 repeats=10, interpret=False) -> dict:
  """Forward + backward ms: Pallas kernel, jnp reference, plain replicated attention.

  ``interpret=True`` runs the kernel in the Pallas interpreter (for tests on CPU; slow).
  """
  args = _attention_inputs(groups, n, p, r, heads, kv_heads, head_dim, dtype)
  w = jax.random.normal(jax.random.key(1), args[0].shape, jnp.float32)
  variants = {
      "kernel": lambda *a: pallas_kernels.shared_prefix_attention(
          *a, interpret=interpret, backend="auto"),
      "reference": lambda *a: pallas_kernels.shared_prefix_attention(*a, backend="reference"),
      "replicated": replicated_attention,
  }
  runners = {}
  for name, attend in variants.items():
    fn = attention_grad_fn(attend)
    runners[name] = lambda fn=fn: jax.block_until_ready(fn(args, w))
  secs = time_interleaved(runners, repeats)
  outs = {name: attend(*args).astype(jnp.float32) for name, attend in variants.items()}
  diff = max(float(jnp.max(jnp.abs(outs[k] - outs["reference"]))) for k in outs)
  return dict(n=n, p=p, r=r, ms={k: 1e3 * v for k, v in secs.items()}, max_diff=diff)


# ------------------------------------------------------------------------------ report
MB = 1 << 20
HEADER = ("| N | P | R | rho | FLOP ratio | replicated ms | packed ms | speedup | speedup/rho "
          "| replicated peak MB (temp) | packed peak MB (temp) | peak ratio |")


def table_row(row: dict) -> str:
  """One markdown table row of a ``bench_config`` result."""
  mem_r, mem_p = row["memory"]["replicated"], row["memory"]["packed"]
  return (f"| {row['n']} | {row['p']} | {row['r']} | {row['rho']:.2f} | {row['flop_ratio']:.2f} "
          f"| {row['ms']['replicated']:.0f} | {row['ms']['packed']:.0f} | {row['speedup']:.2f}x "
          f"| {row['speedup_over_rho']:.2f} | {mem_r['total'] / MB:.0f} ({mem_r['temp'] / MB:.0f}) "
          f"| {mem_p['total'] / MB:.0f} ({mem_p['temp'] / MB:.0f}) "
          f"| {mem_r['total'] / mem_p['total']:.2f}x |")


def markdown_table(rows) -> str:
  """The results table (header, separator, one line per config)."""
  sep = "|" + "---|" * HEADER.count(" | ") + "---|"
  return "\n".join([HEADER, sep] + [table_row(row) for row in rows])


def kernel_lines(results) -> list[str]:
  """Markdown lines for the kernel timings (or the CPU skip note)."""
  if results is None:
    return [f"Kernel timing skipped: backend is {jax.default_backend()} (needs a GPU or TPU)."]
  lines = ["| N | P | R | kernel ms | reference ms | replicated dense ms | max diff |",
           "|---|---|---|---|---|---|---|"]
  for k in results:
    lines.append(f"| {k['n']} | {k['p']} | {k['r']} | {k['ms']['kernel']:.2f} "
                 f"| {k['ms']['reference']:.2f} | {k['ms']['replicated']:.2f} "
                 f"| {k['max_diff']:.1e} |")
  return lines


def write_report(path, argv, cfg, rows, kernels):
  """Markdown report with the command, machine, model and tables."""
  cmd = "python scripts/bench_shared_prefix.py " + " ".join(argv)
  lines = ["# Shared-prefix (packed) vs replicated policy-update step", "",
           f"Command: `{cmd.strip()}`  ", f"Machine: {machine()}  ",
           f"Model: {model_line(cfg)}", "", markdown_table(rows), ""] + kernel_lines(kernels)
  with open(path, "w") as f:
    f.write("\n".join(lines) + "\n")


def machine() -> str:
  return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"backend {jax.default_backend()}, JAX {jax.__version__}")


def model_line(cfg) -> str:
  return (f"{cfg.num_params() / 1e6:.2f}M params (V={cfg.vocab_size}, D={cfg.hidden_size}, "
          f"F={cfg.intermediate_size}, L={cfg.num_layers}, heads {cfg.num_heads}/"
          f"{cfg.num_kv_heads}x{cfg.head_dim}), float32")


def parse_configs(text: str):
  """'N,P,R;N,P,R' -> ((N, P, R), ...)."""
  return tuple(tuple(int(x) for x in part.split(",")) for part in text.split(";") if part)


def main(argv=None) -> dict:
  """Runs the benchmark; returns {'rows': [...], 'kernels': [...] or None}."""
  argv = list(sys.argv[1:] if argv is None else argv)
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="toy model and sizes (smoke test)")
  ap.add_argument("--configs", default=None,
                  help="'N,P,R;N,P,R' (default: 8,512,128;16,1024,256)")
  ap.add_argument("--groups", type=int, default=1, help="prompts per batch (G)")
  ap.add_argument("--repeats", type=int, default=3, help="timed steps per layout")
  ap.add_argument("--out", default=None, help="write a markdown report here")
  args = ap.parse_args(argv)
  cfg = model_config(args.quick)
  configs = (parse_configs(args.configs) if args.configs
             else QUICK_CONFIGS if args.quick else DEFAULT_CONFIGS)
  print(f"model: {model_line(cfg)}\nmachine: {machine()}", flush=True)
  print(HEADER, flush=True)
  rows = []
  for n, p, r in configs:
    rows.append(bench_config(cfg, n, p, r, args.groups, args.repeats))
    print(table_row(rows[-1]) + f"  [log-prob diff {rows[-1]['diff']:.1e}]", flush=True)
  kernels = None
  if jax.default_backend() == "cpu":
    print(kernel_lines(None)[0], flush=True)
  else:
    kernels = [bench_kernel(n, p, r) for n, p, r in configs]
    print("\n".join(kernel_lines(kernels)), flush=True)
  if args.out:
    write_report(args.out, argv, cfg, rows, kernels)
  return {"rows": rows, "kernels": kernels}


if __name__ == "__main__":
  main()
