"""The sampler's decode compiled for a TPU topology, the KV pool split over the batch axes
alone or also over ``sequence``: what a chip holds and reads per decode step.

    python scripts/tpu_sequence_pool.py --model DIR [--topology v5p:2x2x1]
        [--meshes fsdp=4 sequence=4 fsdp=2,sequence=2] [--groups 1] [--samples 8]
        [--prompt-len 256] [--max-new-tokens 32768] [--page-size 64] [--live-tokens 32768]

Needs libtpu (``pip install -e ".[tpu]"``); no TPU. ``DIR`` holds a ``config.json``
(``scripts/tpu_plan.py`` writes them from the published shapes). For each mesh the script
compiles one call of ``rollout.sampler.decode`` (bf16 weights laid out by the mesh rules
``fsdp_tp``; the paged kernel compiled by Mosaic) on a pool that holds every sample's whole
budget, with every sample's first ``--live-tokens`` tokens read (the live-page bucket), and
prints per chip: the pool's bytes, the program's arguments and temporaries
(``memory_analysis``), and the bytes its collectives move (each collective instruction once,
``topology.collectives``). These are the compiler's figures for the chip, not measurements.
(XLA gives no time estimate for a program with a loop, and its byte count does not see
what a Mosaic kernel reads, so neither is printed.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402  pylint: disable=wrong-import-position
import jax.numpy as jnp  # noqa: E402  pylint: disable=wrong-import-position
import numpy as np  # noqa: E402  pylint: disable=wrong-import-position

from rl_jax import models, rollout, sharding  # noqa: E402  pylint: disable=wrong-import-position
from rl_jax.train import topology  # noqa: E402  pylint: disable=wrong-import-position

GiB = 1 << 30


def parse_mesh(text: str) -> dict[str, int]:
  """``fsdp=2,sequence=2`` -> {"fsdp": 2, "sequence": 2}."""
  out = {}
  for part in text.split(","):
    name, _, size = part.partition("=")
    out[name.strip()] = int(size)
  return out


def compile_decode(cfg, mesh, G: int, M: int, P: int, R: int, S: int, pages: int,
                   live: int):
  """``rollout.sampler.decode`` of ``cfg`` compiled on ``mesh`` (rules ``fsdp_tp``) from
  abstract weights and an abstract state of G slots x M samples (prompt P, response R in
  pages of S, a pool of ``pages``), reading ``live`` pages. Returns (compiled, state)."""
  ctx = (mesh, sharding.get_rules("fsdp_tp"))
  init = rollout.kv_cache.init_state.lower(cfg, G, M, P, R, ctx, S=S, pages=pages).compile()
  abstract = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  state = jax.tree.map(lambda x: abstract(x, x.sharding), init.out_info)
  params = jax.tree.map(abstract, jax.eval_shape(lambda: models.init_params(cfg,
                                                                           jax.random.key(0))),
                        models.param_shardings(cfg, mesh, ctx[1]))
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  sp = rollout.records.sampling_params(cfg, 1.0, 0, 1.0, [0], None)[0]
  sp = jax.tree.map(lambda x: abstract(np.asarray(x), rep), sp)
  i32 = jax.ShapeDtypeStruct((), jnp.int32, sharding=rep)
  compiled = rollout.sampler.decode.lower(cfg, params, state, sp, i32, i32, i32, i32,
                                          filtered=False, ctx=ctx, live=live).compile()
  return compiled, state


def measure(cfg, devices, shape: dict[str, int], G: int, M: int, P: int, R: int, S: int,
            live: int) -> dict:
  """One decode call compiled on ``shape`` over ``devices``, a pool of every sample's whole
  budget, every sample's first ``live`` tokens read: the per-chip figures."""
  t0 = time.perf_counter()
  compiled, state = compile_decode(cfg, sharding.make_mesh(shape, devices), G, M, P, R, S,
                                   G * M * (R // S), min(R // S, live // S))
  seconds = time.perf_counter() - t0
  mem, cost = compiled.memory_analysis(), topology.program_cost(compiled)
  pool = state.suffix_k[0]
  pool_bytes = 2 * cfg.num_layers * math.prod(pool.sharding.shard_shape(pool.shape)) * \
      pool.dtype.itemsize
  moved = sum(c["bytes"] for c in cost["collectives"].values())
  return dict(mesh=",".join(f"{k}={v}" for k, v in shape.items()),
              pool_gib=pool_bytes / GiB, arguments_gib=mem.argument_size_in_bytes / GiB,
              temporaries_gib=mem.temp_size_in_bytes / GiB, collective_mib=moved / (1 << 20),
              kernels=",".join(cost["kernels"]), compile_s=seconds)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--model", required=True, help="directory with a config.json")
  p.add_argument("--topology", default="v5p:2x2x1")
  p.add_argument("--meshes", nargs="+", default=["fsdp=4", "sequence=4", "fsdp=2,sequence=2"])
  p.add_argument("--groups", type=int, default=1)
  p.add_argument("--samples", type=int, default=8)
  p.add_argument("--prompt-len", type=int, default=256)
  p.add_argument("--max-new-tokens", type=int, default=32768)
  p.add_argument("--page-size", type=int, default=64)
  p.add_argument("--live-tokens", type=int, default=32768)
  p.add_argument("--json", help="also write the rows here")
  a = p.parse_args(argv)
  cfg = models.hf.read_hf_config(a.model, dtype="bfloat16", param_dtype="bfloat16",
                                 prefix_attention="kernel")
  cfg = cfg.replace(max_position_embeddings=max(cfg.max_position_embeddings,
                                                a.prompt_len + a.max_new_tokens))
  devices = topology.topology_devices(a.topology)
  rows = []
  print(f"{os.path.basename(a.model.rstrip('/'))} on {a.topology}: {a.groups} groups x "
        f"{a.samples} samples, prompt {a.prompt_len}, {a.max_new_tokens} new tokens in pages of "
        f"{a.page_size}, {a.live_tokens} tokens read per sample")
  print("| mesh | pool GiB per chip | arguments GiB per chip | temporaries GiB per chip | "
        "collectives MiB | Mosaic kernels | compile s |")
  print("|---|---|---|---|---|---|---|")
  for text in a.meshes:
    r = measure(cfg, devices, parse_mesh(text), a.groups, a.samples, a.prompt_len,
                a.max_new_tokens, a.page_size, a.live_tokens)
    rows.append(r)
    print(f"| {r['mesh']} | {r['pool_gib']:.2f} | {r['arguments_gib']:.2f} | "
          f"{r['temporaries_gib']:.2f} | {r['collective_mib']:.1f} | {r['kernels']} | "
          f"{r['compile_s']:.0f} |", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
