"""Accelerator figures for docs/BENCHMARKS.md in one run: kernel, update MFU, decode roofline,
quickstart wall time.

1. Shared-prefix attention: the Pallas kernel (``backend="auto"``) against the jnp reference
   and plain masked attention over the replicated sequences (what XLA runs without the
   kernel), forward + backward (grads in every input), at three sizes: max abs difference of
   the outputs and of every gradient vs the reference, and median ms of interleaved calls.
2. The RL update's MFU: one GRPO-style policy update (``bench_shared_prefix.make_step``:
   forward + backward + Adam, donated) on a Qwen3-style policy in bfloat16 compute, packed
   (layer scan, or layers unrolled) and with replicated prompts; model FLOPs per step from
   XLA's ``cost_analysis`` of the packed step compiled for the CPU with the layers unrolled
   and one log-prob chunk (every loop of trip count one, so the count is exact) over the
   median step time, as a fraction of the device's peak (table below).
3. Decode: the bytes one decode step reads (weights + KV cache) over its time (slope between
   two generation lengths: prefill cancels), as a fraction of the device's HBM bandwidth.
4. Paged decode attention: the Pallas paged kernel (``pallas_kernels.paged_decode_attention``,
   Triton on a GPU, Mosaic on a TPU) against its jnp reference (which gathers every row's
   pages), bf16 pools with random lengths and shuffled page tables, including one page per
   row of 8192 tokens (the worst-case slot layout): max abs difference of the output and the
   log-sum-exp, median ms of each, and the live K/V bytes the kernel must read over its time
   as a fraction of the HBM bandwidth. Beside it the GPU kernel with each row's key blocks
   split over several programs (``splits="auto"``, merged by log-sum-exp), timed in the same
   run, with its difference from the reference (on a TPU or CPU, the Triton kernel in the
   Pallas interpreter at the reduced sizes only).
5. The quickstart command's wall time into a fresh workdir (a subprocess; compiles included).

On a GPU or TPU it runs the full sizes. Without one (CPU) it runs every check in a reduced
mode — toy sizes, the kernel in the Pallas interpreter, a 2-step quickstart — so a test or a
quick manual run shows the script works; its rows then say that no accelerator was used and
the fractions are left out (no peak is known for a CPU).

Usage::

    python scripts/accelerator_report.py [--out rows.md]        # on the accelerator host
    python scripts/accelerator_report.py --reduced --skip-quickstart   # CPU smoke run
    python scripts/accelerator_report.py --sections paged,decode        # some sections only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import bench_rollout  # noqa: E402
import bench_shared_prefix as bsp  # noqa: E402
import pallas_kernels  # noqa: E402
from pallas_kernels import paged_attention  # noqa: E402
from rl_jax import models  # noqa: E402

# Dense peak (bfloat16 matmul FLOP/s, HBM bytes/s) by a substring of device_kind, from the
# vendors' data sheets (SXM parts; no sparsity).
PEAKS = {
    "H100": (989e12, 3.35e12), "H200": (989e12, 4.8e12), "A100": (312e12, 2.0e12),
    "TPU v4": (275e12, 1.2e12), "TPU v5 lite": (197e12, 0.82e12), "TPU v5e": (197e12, 0.82e12),
    "TPU v5p": (459e12, 2.76e12), "TPU v5": (459e12, 2.76e12), "TPU v6": (918e12, 1.64e12),
}
# (rows B, kv heads K, query heads per kv head J, head dim H, page size S, longest length)
PAGED_SIZES = {"full": [(64, 8, 4, 128, 64, 2048), (64, 8, 4, 128, 64, 8192),
                        (16, 8, 4, 128, 8192, 8192), (4, 8, 4, 128, 64, 32768)],
               "reduced": [(3, 2, 2, 16, 16, 40), (2, 1, 2, 16, 64, 64),
                           (2, 1, 2, 16, 16, 512)]}
KERNEL_SIZES = {"full": [(16, 1024, 256), (16, 2048, 512), (32, 4096, 512)],
                "reduced": [(2, 8, 4), (3, 16, 8), (4, 32, 8)]}


def device_peaks() -> tuple[str, float | None, float | None]:
  kind = jax.devices()[0].device_kind
  for key, (flops, bw) in PEAKS.items():
    if key.lower() in kind.lower():
      return kind, flops, bw
  return kind, None, None


def _median_ms(fn, repeats: int) -> float:
  jax.block_until_ready(fn())
  ts = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    ts.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(ts))


def kernel_rows(reduced: bool, repeats: int, sizes=None) -> list[dict]:
  """Forward/gradient exactness of the kernel vs the reference, and ms of all three, at
  ``sizes`` ((N, P, R) triples; default the mode's three)."""
  interpret = jax.default_backend() == "cpu"
  dtype = jnp.float32 if reduced else jnp.bfloat16
  heads, kv_heads, head_dim = (2, 1, 8) if reduced else (8, 2, 128)
  rows = []
  for n, p, r in sizes or KERNEL_SIZES["reduced" if reduced else "full"]:
    args = bsp._attention_inputs(1, n, p, r, heads, kv_heads, head_dim, dtype)  # pylint: disable=protected-access
    w = jax.random.normal(jax.random.key(1), args[0].shape, jnp.float32)
    variants = {
        "kernel": lambda *a: pallas_kernels.shared_prefix_attention(
            *a, interpret=interpret, backend="auto"),
        "reference": lambda *a: pallas_kernels.shared_prefix_attention(*a,
                                                                       backend="reference"),
        "xla": bsp.replicated_attention,
    }
    grads = {k: bsp.attention_grad_fn(f) for k, f in variants.items()}
    outs = {k: jax.jit(f)(*args).astype(jnp.float32) for k, f in variants.items()}
    g = {k: fn(args, w) for k, fn in grads.items()}
    fwd = float(jnp.max(jnp.abs(outs["kernel"] - outs["reference"])))
    bwd = max(float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
              for a, b in zip(g["kernel"], g["reference"]))
    ms = {k: _median_ms(lambda fn=fn: fn(args, w), repeats) for k, fn in grads.items()}
    rows.append(dict(n=n, p=p, r=r, fwd_diff=fwd, grad_diff=bwd, ms=ms,
                     dtype=jnp.dtype(dtype).name))
  return rows


def _paged_inputs(b, k, j, h, s, longest, dtype, seed=0):
  """q [B,K,J,H], pools [Pg,K,H,S] / [Pg,K,S,H] of exactly the pages the rows need, a
  shuffled table [B,nb], start 0 and lengths uniform in [longest/8, longest]."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(max(longest // 8, 1), longest + 1, b)
  need = -(-lengths // s)
  nb, pg = int(-(-longest // s)), int(need.sum())
  table = np.full((b, nb), -1, np.int32)
  ids = rng.permutation(pg)
  at = np.concatenate([[0], np.cumsum(need)])
  for r in range(b):
    table[r, :need[r]] = ids[at[r]:at[r + 1]]
  keys = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(keys[0], (b, k, j, h), dtype)
  pk = jax.random.normal(keys[1], (pg, k, h, s), dtype)
  pv = jax.random.normal(keys[2], (pg, k, s, h), dtype)
  return (q, pk, pv, jnp.asarray(table), jnp.zeros(b, jnp.int32),
          jnp.asarray(lengths, jnp.int32)), int(lengths.sum())


def paged_rows(reduced: bool, repeats: int, peak_bw: float | None) -> list[dict]:
  """The paged decode kernel vs its jnp reference: max differences, ms, live bytes/s."""
  interpret = jax.default_backend() == "cpu"
  dtype = jnp.float32 if reduced else jnp.bfloat16
  rows = []
  for b, k, j, h, s, longest in PAGED_SIZES["reduced" if reduced else "full"]:
    args, tokens = _paged_inputs(b, k, j, h, s, longest, dtype)
    scale = h ** -0.5
    kernel = jax.jit(lambda *a: pallas_kernels.paged_decode_attention(
        *a, scale=scale, interpret=interpret))
    reference = jax.jit(lambda *a: pallas_kernels.paged_decode_reference(*a, scale=scale))
    (o, lse), (eo, else_) = kernel(*args), reference(*args)
    fns = {"kernel": kernel, "reference": reference}
    on_gpu = jax.default_backend() == "gpu"
    splits = None
    if on_gpu or reduced:  # the Triton kernel, each row's key blocks over several programs
      splits = paged_attention.auto_splits(b, k, args[3].shape[1], s)  # what "auto" picks
      fns["split"] = jax.jit(lambda *a, c=splits: pallas_kernels.paged_decode_attention(
          *a, scale=scale, platform="gpu", interpret=not on_gpu, splits=c))
      so, slse = fns["split"](*args)
    ms = {name: [] for name in fns}
    for _ in range(repeats):  # interleaved: one call of each per round (all compiled above)
      for name, fn in fns.items():
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        ms[name].append((time.perf_counter() - t0) * 1e3)
    ms = {name: float(np.median(t)) for name, t in ms.items()}
    live = 2 * tokens * k * h * jnp.dtype(dtype).itemsize  # keys + values of valid positions
    bw = lambda name: live / (ms[name] / 1e3)
    rows.append(dict(b=b, k=k, j=j, h=h, s=s, longest=longest, dtype=jnp.dtype(dtype).name,
                     out_diff=float(jnp.max(jnp.abs(o - eo))),
                     lse_diff=float(jnp.max(jnp.abs(lse - else_))), ms=ms, live=live,
                     achieved=bw("kernel"),
                     fraction=None if peak_bw is None else bw("kernel") / peak_bw,
                     splits=splits,
                     split_out_diff=None if splits is None else float(jnp.max(jnp.abs(so - eo))),
                     split_lse_diff=None if splits is None else float(
                         jnp.max(jnp.abs(jnp.where(jnp.isfinite(else_), slse - else_, 0)))),
                     split_fraction=(None if peak_bw is None or splits is None
                                     else bw("split") / peak_bw)))
  return rows


def _update_model(reduced: bool):
  """(config, params, batch, optimizer) of the update benchmark: a Qwen3-style policy,
  bfloat16 compute, one prompt of P tokens and N responses of R tokens."""
  hidden, layers, n, p, r = (32, 2, 4, 8, 8) if reduced else (1024, 8, 16, 512, 512)
  cfg = models.ModelConfig(architecture="qwen3", vocab_size=256 if reduced else 32768,
                           hidden_size=hidden, intermediate_size=3 * hidden, num_layers=layers,
                           num_heads=8 if not reduced else 4, num_kv_heads=2,
                           head_dim=hidden // (8 if not reduced else 4), qk_norm=True,
                           max_position_embeddings=4096,
                           dtype="float32" if reduced else "bfloat16")
  params = models.init_params(cfg, jax.random.key(0))
  return cfg, params, bsp.make_batch(cfg, 1, n, p, r), optax.adam(1e-5)


def _flops_on_cpu(reduced: bool) -> float:
  """Model FLOPs of one packed update, counted by XLA's ``cost_analysis`` of the step
  compiled (never run) with the layers unrolled and one log-prob chunk, so every loop has
  trip count one and the count is exact. Counted for the CPU (in a process that sees only
  the CPU): a GPU executable's matmuls are library calls its cost analysis leaves out, and
  the attention kernel's custom call has no count on any backend (the CPU runs its jnp
  reference, which does the same arithmetic)."""
  if jax.default_backend() != "cpu":
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--flops-worker"]
                         + (["--reduced"] if reduced else []), cwd=ROOT, check=True,
                         capture_output=True, text=True,
                         env=dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT))
    return float(out.stdout.strip().splitlines()[-1])
  cfg, params, batch, opt = _update_model(reduced)
  exact = cfg.replace(scan_layers=False, logits_chunk=batch["response_tokens"].size)
  return bsp.compiled_flops(bsp.compile_step(exact, opt, True, params, opt.init(params),
                                             batch))


UPDATE_VARIANTS = (  # (name, shared_prefix, config overrides)
    ("packed, layer scan (default)", True, {}),
    ("packed, layers unrolled", True, {"scan_layers": False}),
    ("replicated prompts", False, {}),
)


def update_mfu(reduced: bool, repeats: int, peak_flops: float | None) -> list[dict]:
  """The RL update's median ms in each ``UPDATE_VARIANTS`` layout, and the useful model
  FLOP/s (the packed step's FLOPs over each variant's time) as a fraction of the peak."""
  cfg, params, batch, opt = _update_model(reduced)
  flops = _flops_on_cpu(reduced)
  rows = []
  for name, shared_prefix, overrides in UPDATE_VARIANTS:
    step = jax.jit(bsp.make_step(cfg.replace(**overrides), opt, shared_prefix),
                   donate_argnums=(0, 1))
    state = {"p": jax.tree.map(jnp.copy, params)}
    state["o"] = opt.init(state["p"])

    def run(step=step, state=state):
      state["p"], state["o"], loss = step(state["p"], state["o"], batch)
      return loss

    ms = _median_ms(run, repeats)
    achieved = flops / (ms / 1e3)
    tokens = batch["prompt_tokens"].size + batch["response_tokens"].size
    rows.append(dict(name=name, params=cfg.num_params(), tokens=tokens, flops=flops, ms=ms,
                     achieved=achieved, dtype=cfg.dtype,
                     mfu=None if peak_flops is None else achieved / peak_flops))
    del state
  return rows


def decode_roofline(reduced: bool, repeats: int, peak_bw: float | None) -> dict:
  cfg = models.ModelConfig(architecture="qwen3", vocab_size=512 if reduced else 32768,
                           hidden_size=64 if reduced else 1024,
                           intermediate_size=128 if reduced else 3072,
                           num_layers=2 if reduced else 8, num_heads=4 if reduced else 8,
                           num_kv_heads=2, head_dim=16 if reduced else 128, qk_norm=True,
                           max_position_embeddings=1024,
                           dtype="float32" if reduced else "bfloat16",
                           param_dtype="float32" if reduced else "bfloat16")
  params = models.init_params(cfg, jax.random.key(0))
  row = bench_rollout.bench_bandwidth(cfg, params, batch=4 if reduced else 64,
                                      prompt_len=16 if reduced else 128, repeats=repeats)
  row["fraction"] = None if peak_bw is None else row["achieved"] / peak_bw
  return row


def quickstart_wall(reduced: bool) -> dict:
  extra = (["--config.sft.steps=2", "--config.train.steps=2", "--config.train.eval_every=0"]
           if reduced else [])
  with tempfile.TemporaryDirectory() as d:
    cmd = [sys.executable, "-m", "rl_jax.train", "--config=configs/quickstart.py",
           f"--workdir={d}/qs", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    seconds = time.perf_counter() - t0
    if proc.returncode:
      raise RuntimeError(f"quickstart exited {proc.returncode}: {proc.stderr[-2000:]}")
    with open(f"{d}/qs/metrics.jsonl") as f:
      rows = [json.loads(line) for line in f]
    accs = [r["eval_accuracy"] for r in rows if "eval_accuracy" in r]
    return dict(seconds=seconds, args=" ".join(extra), first=accs[0] if accs else None,
                last=accs[-1] if accs else None)


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--reduced", action="store_true",
                  help="toy sizes (automatic without a GPU/TPU)")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--skip-quickstart", action="store_true")
  ap.add_argument("--sections", default="kernel,update,decode,paged,quickstart",
                  help="comma-separated sections to run, in the report's order")
  ap.add_argument("--out", default=None, help="also write the rows to this markdown file")
  ap.add_argument("--flops-worker", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.flops_worker:
    print(_flops_on_cpu(args.reduced))
    return None
  backend = jax.default_backend()
  accel = backend in ("gpu", "cuda", "rocm", "tpu")
  reduced = args.reduced or not accel
  repeats = 2 if reduced else args.repeats
  kind, peak_flops, peak_bw = device_peaks()
  if not accel:
    peak_flops = peak_bw = None
  out = {"device": kind, "backend": backend, "accelerator": accel, "reduced": reduced}
  sections = [("kernel", lambda: kernel_rows(reduced, repeats)),
              ("update", lambda: update_mfu(reduced, repeats, peak_flops)),
              ("decode", lambda: decode_roofline(reduced, repeats, peak_bw)),
              ("paged", lambda: paged_rows(reduced, repeats, peak_bw)),
              ("quickstart", lambda: None if args.skip_quickstart else quickstart_wall(reduced))]
  chosen = args.sections.split(",")
  unknown = sorted(set(chosen) - {name for name, _ in sections})
  if unknown:
    ap.error(f"--sections: unknown {unknown}; choose from kernel,update,decode,paged,quickstart")
  errors = {}
  for name, fn in sections:
    if name not in chosen:
      out[name] = None
      continue
    # A section that fails on a new device (a kernel the backend cannot lower, memory) is
    # reported and the others still run: one lease of an accelerator gives every figure it can.
    try:
      out[name] = fn()
    except Exception as e:  # pylint: disable=broad-except
      if not accel:
        raise
      out[name] = None
      errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
      traceback.print_exc()
    print(f"[{name}] {out[name] if name not in errors else errors[name]}", flush=True)

  pct = lambda x: "n/a" if x is None else f"{x:.1%}"
  head = (f"Device: {kind} ({backend}), JAX {jax.__version__}"
          + ("" if accel else "; NO ACCELERATOR: reduced mode on the CPU, the checks ran at toy "
             "sizes (kernel in the Pallas interpreter); no figure here is an accelerator "
             "figure") + (", reduced sizes" if accel and reduced else "") + ".")
  lines = [head, "", "| N | P | R | dtype | kernel ms | reference ms | XLA replicated ms | "
           "kernel vs XLA | max diff out | max diff grads |",
           "|---|---|---|---|---|---|---|---|---|---|"]
  for k in out["kernel"] or []:
    lines.append(f"| {k['n']} | {k['p']} | {k['r']} | {k['dtype']} | {k['ms']['kernel']:.2f} | "
                 f"{k['ms']['reference']:.2f} | {k['ms']['xla']:.2f} | "
                 f"{k['ms']['xla'] / k['ms']['kernel']:.2f}x | {k['fwd_diff']:.1e} | "
                 f"{k['grad_diff']:.1e} |")
  lines += ["", "| RL update (GRPO step, Adam) | parameters | tokens | dtype | model GFLOP / step "
            "| ms / step | TFLOP/s | MFU |", "|---|---|---|---|---|---|---|---|"]
  for u in out["update"] or []:
    lines.append(f"| {u['name']} | {u['params'] / 1e6:.2f}M | {u['tokens']} | {u['dtype']} | "
                 f"{u['flops'] / 1e9:.1f} | {u['ms']:.1f} | {u['achieved'] / 1e12:.3f} | "
                 f"{pct(u['mfu'])} |")
  dec = out["decode"] or dict(batch=0, step_ms=float("nan"), weights=0, kv=0, achieved=0,
                              fraction=None)
  lines += ["", "| decode | batch | ms / step | weights MiB | KV MiB | GB/s | of HBM peak |",
            "|---|---|---|---|---|---|---|",
            f"| greedy | {dec['batch']} | {dec['step_ms']:.2f} | {dec['weights'] / 2**20:.1f} | "
            f"{dec['kv'] / 2**20:.1f} | {dec['achieved'] / 1e9:.1f} | {pct(dec['fraction'])} |"]
  lines += ["", "| paged decode | rows | K x J x H | page | longest | dtype | kernel ms | "
            "reference ms | live K/V MiB | GB/s | of HBM peak | max diff out | max diff lse | "
            "split: programs per row and kv head | split ms | split, of HBM peak | "
            "split, max diff out |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
  for r in out["paged"] or []:
    split = ("| | | | " if r.get("splits") is None else
             f"{r['splits']} | {r['ms']['split']:.3f} | {pct(r['split_fraction'])} | "
             f"{r['split_out_diff']:.1e} |")
    lines.append(f"| {'one page per row' if r['s'] >= r['longest'] else 'pages'} | {r['b']} | "
                 f"{r['k']} x {r['j']} x {r['h']} | {r['s']} | {r['longest']} | {r['dtype']} | "
                 f"{r['ms']['kernel']:.3f} | {r['ms']['reference']:.3f} | "
                 f"{r['live'] / 2**20:.1f} | {r['achieved'] / 1e9:.1f} | {pct(r['fraction'])} | "
                 f"{r['out_diff']:.1e} | {r['lse_diff']:.1e} | {split}")
  if out["quickstart"]:
    q = out["quickstart"]
    acc = ("" if q.get("last") is None else
           f"; held-out accuracy {q['first']:.3f} -> {q['last']:.3f}")
    lines += ["", f"Quickstart wall time (fresh workdir, compiles included"
              f"{', ' + q['args'] if q['args'] else ''}): {q['seconds']:.1f} s{acc}"]
  lines += [f"\nFailed on this device: {k}: {v}" for k, v in errors.items()]
  report = "\n".join(lines) + "\n"
  print(report, end="")
  if args.out:
    with open(args.out, "w") as f:
      f.write(report)
  out["report"] = report
  return out


if __name__ == "__main__":
  main()
