"""One GRPO step with and without the separate old-log-prob pass, and the sampler alone.

A random Qwen3-style policy (hidden 256, 4 layers, 4 query / 2 KV heads of 64, MLP 896,
256-symbol vocabulary: 3.7M parameters), 1 prompt x 16 samples, 64 new tokens, GRPO
(one minibatch: on-policy). Two trainers on the same weights and the same step:

* ``separate``: ``train.old_logp_pass=separate`` (a teacher-forced pass computes old_logp);
* ``auto``: the update takes old_logp from its own policy pass (``rl_jax.train.on_policy``);
* ``auto+trim``: ``auto``'s trainer, with the host heap handed back to the OS before every
  update (``release_host_memory``), as the learner does for policies of
  ``learner.TRIM_MIN_PARAM_BYTES`` or more (this 3.7M-parameter one is below it).

Reported: the first step of each (compile included, and the compile time alone), then the
median of ``--repeats`` interleaved steps (each variant re-runs step 0 from its own copy
of the initial state, so both always do the same work), and the sampler's tokens/s
(``rollout.generate``, 1 x 16 samples, 64 new tokens, warm).

With ``--profile DIR`` it also traces 3 steps of ``auto`` into DIR and prints where they
spend their time (``rl_jax.profiling``: exclusive XLA op time per program and kind of op).

Usage::

    python scripts/bench_step.py --repeats 10 [--profile /tmp/step_profile]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from rl_jax import config_utils, profiling, train  # noqa: E402
from rl_jax.train import learner, rollouts, startup  # noqa: E402

QUICKSTART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                          "configs", "quickstart.py")
MODEL = ["model.hidden_size=256", "model.intermediate_size=896", "model.num_layers=4",
         "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=64",
         "model.max_position_embeddings=128", "model.init_std=0.02"]
STEP = ["sft.steps=0", "train.batch_groups=1", "rollout.n=16", "rollout.max_new_tokens=64",
        "rollout.temperature=1.0", "train.eval_every=0", "train.compile_cache=",
        "log.tensorboard=False", "loss.preset=grpo"]


def make(mode: str, extra=()):
  config = config_utils.load_config(QUICKSTART, MODEL + STEP + [
      f"train.old_logp_pass={mode}", *extra])
  s = train.build_setup(config)
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  return s, t, state


def one_step(t, state):
  """rl_step on a copy of ``state`` (its buffers are donated); seconds and the record."""
  state = jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)
  jax.block_until_ready(state)
  t0 = time.perf_counter()
  new, record, _ = train.rl_step(t, state)
  jax.block_until_ready(new.params)
  return time.perf_counter() - t0, record


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--profile", default="", help="trace 3 steps of `auto` into this directory")
  args = ap.parse_args(argv)
  clock = startup.compile_clock()
  variants = {m: make(m) for m in ("separate", "auto")}
  variants["auto+trim"] = variants["auto"]  # same programs; differs in the trim only
  trim_default = learner.TRIM_MIN_PARAM_BYTES
  n_params = sum(x.size for x in jax.tree.leaves(variants["auto"][2].params))
  out = {"params": n_params, "first_s": {}, "compile_s": {}, "step_s": {}}
  for m, (s, t, state) in variants.items():
    learner.TRIM_MIN_PARAM_BYTES = 0 if m == "auto+trim" else trim_default
    clock.take()
    out["first_s"][m], _ = one_step(t, state)
    out["compile_s"][m] = clock.take()
  times = {m: [] for m in variants}
  for _ in range(args.repeats):
    for m, (s, t, state) in variants.items():
      learner.TRIM_MIN_PARAM_BYTES = 0 if m == "auto+trim" else trim_default
      times[m].append(one_step(t, state)[0])
  learner.TRIM_MIN_PARAM_BYTES = trim_default
  out["step_s"] = {m: float(np.median(v)) for m, v in times.items()}

  s, t, state = variants["auto"]
  prompt = rollouts.encode_prompts(s, s.train_examples[:1])
  params = t.layout.sampler_params(state.params)
  gen = lambda: rollouts.generate(s, params, prompt, n=16, temperature=1.0, seed=0)
  gen()
  tok_s = []
  for _ in range(args.repeats):
    t0 = time.perf_counter()
    r = gen()
    n_tok = int(np.asarray(r.mask).sum())
    tok_s.append(n_tok / (time.perf_counter() - t0))
  out["sampler_tokens_per_s"] = float(np.median(tok_s))
  print(f"policy: {n_params / 1e6:.2f}M parameters; JAX {jax.__version__} "
        f"{jax.default_backend()}; {os.cpu_count()} CPUs")
  print("| variant | first step (s) | of it compiling (s) | step, median (s) |")
  print("|---|---|---|---|")
  for m in variants:
    print(f"| {m} | {out['first_s'][m]:.2f} | {out['compile_s'][m]:.2f} | "
          f"{out['step_s'][m]:.3f} |")
  if args.profile:
    copies = [jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, state)
              for _ in range(3)]
    jax.block_until_ready(copies)
    jax.profiler.start_trace(args.profile, create_perfetto_trace=True)
    for c in copies:
      jax.block_until_ready(train.rl_step(t, c)[0].params)
    jax.profiler.stop_trace()
    out["profile"] = profiling.summarize(args.profile, top=12)
    print(out["profile"])
  print(f"auto vs separate: {out['step_s']['separate'] / out['step_s']['auto']:.2f}x; "
        f"auto vs auto+trim: {out['step_s']['auto+trim'] / out['step_s']['auto']:.2f}x; "
        f"sampler: {out['sampler_tokens_per_s']:.0f} tokens/s (median, 1 x 16 x 64)")
  return out


if __name__ == "__main__":
  main()
