"""rl_jax vs Tunix side by side: sampler tokens/s and one GRPO step on the same weights.

The same random Qwen3-style weights (hidden 256, 4 layers, 4 query / 2 KV heads of 64, MLP
896, 256-symbol byte vocabulary: 3.7M parameters) are written once in Hugging Face format
(``models.save_hf``) and loaded by both sides: rl_jax with ``models.load_hf``, Tunix with its
Qwen3 safetensors loader. Workload: 1 prompt x 16 samples (``--samples``), at most 64 new
tokens (``--new-tokens``), temperature 1.0, float32. The sampler part has no EOS (every sample
is that long); in the GRPO part both trainers stop a sample at EOS id 255 (same weights, so the
same length distribution; tokens are counted, not assumed). The prompt is the 9-byte question
(10 tokens with BOS), or ``--prompt-tokens N`` tokens: instruction text before the same
question, the one shared prompt a real task's template makes longer (rl_jax samples and trains
it once per group; the peers once per sample). Positions: the weights' context and Tunix's KV
cache are 128, or the prompt's positions (N, at least 16) + ``--new-tokens`` when more.

* sampler: rl_jax ``rollout.generate(n=16)`` vs Tunix ``Sampler`` on the prompt repeated 16
  times; tokens/s, median of the repeats (after a warm-up call, whose time is the compile).
* GRPO step: rl_jax's trainer step (``train.rl_step``: rollouts, rewards, advantages,
  update; ``train.old_logp_pass=auto``; rl_jax's defaults unless a flag says otherwise:
  ``--[no-]fused-mlp`` sets ``model.fused_mlp``,
  ``--prefix-attention`` ``model.prefix_attention``, ``--[no-]fast-compile``
  ``train.cpu_fast_compile``, ``--[no-]xla-reductions`` ``train.cpu_xla_reductions`` (both on
  by default, as in rl_jax), ``--temp-block-mib`` ``train.cpu_temp_block_mib`` (0, off, by
  default, as in rl_jax), ``--remat`` ``model.remat``, ``--pack-floor``
  ``train.pack_floor``; the same
  prompt every step and the peers' learning rate, 1e-5) vs Tunix's
  ``GRPOLearner`` (num_generations 16, beta 0, one minibatch); wall time per step from the
  reward function's call times.

Each side runs in its own process and virtual environment (Tunix in ``--tunix-python``'s
venv, so it cannot change this one's packages); the sides alternate over ``--rounds``.
``--lockstep PAIRS`` instead keeps both processes up and has them take turns: one sampler call
each (untimed), then ``PAIRS`` pairs of calls, two GRPO steps each (untimed), then ``PAIRS``
pairs of steps, the side that goes first swapped every pair; each pair's ratio is reported,
median and worst. A pair is timed seconds apart, so a slow minute of a shared host lands on
both of its sides. Tunix's step is then the time from the start of its turn to the next
step's reward call (the rest of the step before, its update, and this step's rollout: one
step's work); its learner waits inside the reward call for its next turn.
``--host-heap-reuse rljax`` starts the rl_jax side with ``reuse_large_blocks`` (a host
setting measured here, not part of rl_jax: programs run on the calling thread and glibc keeps
large freed blocks, so XLA's per-call temporaries are not faulted in again); ``both`` does the
same first thing in Tunix's process too, as a fair comparison must.

Usage::

    python3 -m venv /work/venvs/tunix && /work/venvs/tunix/bin/pip install google-tunix
    python scripts/bench_tunix.py --tunix-python /work/venvs/tunix/bin/python --rounds 2
    python scripts/bench_tunix.py --tunix-python /work/venvs/tunix/bin/python --lockstep 20
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Callable

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, MLP, VOCAB = 256, 4, 4, 2, 64, 896, 256
N, NEW_TOKENS, PROMPT = 16, 64, "sort 302:"
NEVER = 300  # sampler part: an EOS id outside the vocabulary (always NEW_TOKENS tokens)
EOS = 255  # GRPO part: both trainers need an EOS in the vocabulary (~1/256 per token)
MAX_PROMPT = 16  # prompt positions on every side (the prompt itself is 9 bytes)
# ``--prompt-tokens``: a longer shared prompt, as a chat-templated task with its instructions
# is (a few hundred tokens before the question), made of this text, then ``PROMPT``
INSTRUCTIONS = ("You are a careful assistant. Sort the digits of the number that follows in "
                "ascending order and answer with the sorted digits only. ")


def set_prompt_tokens(tokens: int) -> None:
  """Makes the prompt ``tokens`` tokens long with its BOS (``PROMPT``: instructions, then the
  9-byte question) and ``MAX_PROMPT`` its positions, for every side of this process
  (``--prompt-tokens``)."""
  global PROMPT, MAX_PROMPT  # pylint: disable=global-statement
  question = "sort 302:"
  if tokens < len(question) + 1:
    raise ValueError(f"--prompt-tokens must be at least {len(question) + 1}, got {tokens}")
  filler = (INSTRUCTIONS * (tokens // len(INSTRUCTIONS) + 1))[:tokens - 1 - len(question)]
  PROMPT, MAX_PROMPT = filler + question, max(16, tokens)


# the rl_jax trainer's programs whose backend compile the first GRPO step reports
FIRST_STEP = ("jit(update)", "jit(admit)", "jit(decode)")


def context(new_tokens: int = NEW_TOKENS) -> int:
  """Positions of the weights' config and of Tunix's KV cache: 128 (the 64-token workload's),
  or the prompt's positions (16, or ``--prompt-tokens``) + ``new_tokens`` when more."""
  return max(128, MAX_PROMPT + new_tokens)


def write_weights(path: str, new_tokens: int = NEW_TOKENS) -> None:
  """The shared random weights, in HF format (config.json + model.safetensors)."""
  import jax  # pylint: disable=import-outside-toplevel
  sys.path.insert(0, ROOT)
  from rl_jax import models  # pylint: disable=import-outside-toplevel
  cfg = models.ModelConfig(architecture="qwen3", vocab_size=VOCAB, hidden_size=HIDDEN,
                           intermediate_size=MLP, num_layers=LAYERS, num_heads=HEADS,
                           num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                           max_position_embeddings=context(new_tokens), qk_norm=True)
  params = models.init_params(cfg, jax.random.key(0), std=0.02)
  models.save_hf(cfg, params, path)


def _reward(completion: str) -> float:
  return float(len(completion) % 2)  # any reward with variance inside a group


def reuse_large_blocks(keep_bytes: int = 1 << 30) -> None:
  """``--host-heap-reuse``: single-device CPU programs run on the calling thread
  (``jax_cpu_enable_async_dispatch=False``), so XLA's per-call block of temporaries comes from
  glibc's main arena, which serves large blocks from its heap (``M_MMAP_MAX=0``) and keeps up
  to ``keep_bytes`` free (``M_TRIM_THRESHOLD``) instead of mapping and faulting them in on
  every call. Only before the process's first JAX computation; glibc only."""
  import ctypes  # pylint: disable=import-outside-toplevel
  import ctypes.util  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  libc = ctypes.CDLL(ctypes.util.find_library("c"))
  if not hasattr(libc, "gnu_get_libc_version"):
    raise SystemExit("--host-heap-reuse needs glibc")
  m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
  if not (libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, keep_bytes)):
    raise SystemExit("--host-heap-reuse: glibc's mallopt refused the settings")
  jax.config.update("jax_cpu_enable_async_dispatch", False)


def alternate_sides(rounds: int, sides: tuple[str, str], new_tokens: int,
                    command: Callable[[str, str], list[str]]) -> dict:
  """The comparison's rounds (this script's and ``bench_trl.py``'s): the shared weights
  written to a temporary directory (removed however the rounds end), then each side in its
  own process, ``command(side, weights)`` its argv (the rl_jax side with this checkout on
  ``PYTHONPATH``), the first side first in even rounds and last in odd ones.

  Returns:
    {side: [the JSON object the side printed last, one per round]}.
  """
  results = {side: [] for side in sides}
  with tempfile.TemporaryDirectory(prefix="bench_weights_") as weights:
    write_weights(weights, new_tokens)
    for r in range(rounds):
      for side in (sides if r % 2 == 0 else sides[::-1]):
        env = dict(os.environ, PYTHONPATH=ROOT if side == "rljax" else "")
        out = subprocess.run(command(side, weights), capture_output=True, text=True, env=env)
        if out.returncode != 0:
          raise RuntimeError(f"{side} failed:\n{out.stderr[-3000:]}")
        results[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(side, r, results[side][-1], flush=True)
  return results


# ------------------------------------------------------------------------------- lockstep
# ``--lockstep PAIRS``: both sides' processes stay up and take turns, one sampler call or one
# GRPO step at a time, so that each pair is timed seconds apart: the host's slow and fast
# minutes land on both sides of a pair instead of on whichever side ran through them.
SAY = "@@ "  # a served child's answers on stdout start with this; any other line is a log
LOCKSTEP_MAX_STEPS = 10_000  # the peers' learners are given this many batches to train on
BLOCK = 5  # pairs per block in the report (as many timed calls as a round's --repeats 5)


def say(obj: dict) -> None:
  """A served child's answer: one line, ``SAY`` then JSON."""
  print(SAY + json.dumps(obj), flush=True)


def serve(commands: dict[str, Callable[[], dict]]) -> str:
  """A served child (``--serve``): says it is ready, then for each command named on a line of
  stdin runs it and says its result with ``"s"``, the call's wall time. Returns the first
  line that is not one of ``commands`` (``"quit"`` at the end of stdin), for the caller to
  act on."""
  say({"ready": True})
  for line in sys.stdin:
    name = line.strip()
    if name not in commands:
      return name
    t0 = time.perf_counter()
    out = commands[name]()
    say({"s": time.perf_counter() - t0, **out})
  return "quit"


def serve_rljax(weights: str, n: int, new_tokens: int, fast_compile: bool,
                **trainer_kwargs) -> None:
  """rl_jax's served child: ``sample`` (one sampler call) and ``step`` (one GRPO step)."""
  gen = _rljax_sampler(weights, n, new_tokens, fast_compile)
  step = _rljax_trainer(weights, n=n, new_tokens=new_tokens, fast_compile=fast_compile,
                        **trainer_kwargs)
  serve({"sample": lambda: {"tokens": gen()},
         "step": lambda: {"tokens": step()["response_length"] * n}})


def serve_tunix(weights: str, n: int, new_tokens: int) -> None:
  """Tunix's served child: ``sample`` until the first ``step``; then its learner trains, and
  every step's reward call answers the time since the last ``step`` was asked (the rest of
  the step before, its update, and this step's rollout: one step's work) and waits for the
  next. Another line ends the process from inside the learner."""
  gen = _tunix_sampler(weights, n, new_tokens)
  if serve({"sample": lambda: {"tokens": gen()}}) != "step":
    return
  asked = [time.perf_counter()]

  def on_reward():
    say({"s": time.perf_counter() - asked[0]})
    if sys.stdin.readline().strip() != "step":
      os._exit(0)  # pylint: disable=protected-access
    asked[0] = time.perf_counter()

  learner, data = _tunix_learner(weights, LOCKSTEP_MAX_STEPS, n, new_tokens, on_reward)
  learner.train(data)


def lockstep(pairs: int, sides: tuple[str, str], new_tokens: int,
             command: Callable[[str, str], list[str]], warmup: dict[str, int]) -> dict:
  """Both sides served at once (``command(side, weights)``: a child that answers like
  ``serve``), on shared weights written to a temporary directory (removed however it ends).
  For each command in ``warmup`` (sampler calls, then GRPO steps), ``warmup[name]`` untimed
  turns per side, then ``pairs`` timed pairs, the first side first in even pairs.

  Returns:
    {name: {side: [each timed turn's answer]}}.
  """
  with tempfile.TemporaryDirectory(prefix="bench_weights_") as weights:
    write_weights(weights, new_tokens)
    procs, logs = {}, {}
    try:
      for side in sides:
        logs[side] = tempfile.TemporaryFile("w+")
        env = dict(os.environ, PYTHONPATH=ROOT if side == "rljax" else "")
        procs[side] = subprocess.Popen(command(side, weights), stdin=subprocess.PIPE,
                                       stdout=subprocess.PIPE, stderr=logs[side], text=True,
                                       env=env)

      def answer(side: str) -> dict:
        for line in procs[side].stdout:
          if line.startswith(SAY):
            return json.loads(line[len(SAY):])
        logs[side].seek(0)
        raise RuntimeError(f"{side} failed:\n{logs[side].read()[-3000:]}")

      def ask(side: str, name: str) -> dict:
        try:
          procs[side].stdin.write(name + "\n")
          procs[side].stdin.flush()
        except OSError:
          pass  # the child has ended: answer() reports its log
        return answer(side)

      for side in sides:
        answer(side)  # ready
      results = {name: {side: [] for side in sides} for name in warmup}
      for name, turns in warmup.items():
        for _ in range(turns):
          for side in sides:
            ask(side, name)
        for i in range(pairs):
          for side in (sides if i % 2 == 0 else sides[::-1]):
            results[name][side].append(ask(side, name))
        print(name, {side: [round(a["s"], 3) for a in results[name][side]] for side in sides},
              flush=True)
      return results
    finally:
      for side, proc in procs.items():
        if proc.poll() is None:
          try:
            proc.stdin.write("quit\n")
            proc.stdin.close()
            proc.wait(timeout=60)
          except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill()
            proc.wait()
        proc.stdout.close()
        logs[side].close()


# ----------------------------------------------------------------------------- rl_jax side
def run_rljax(weights: str, steps: int, repeats: int, fused_mlp: bool | None = None, n: int = N,
              new_tokens: int = NEW_TOKENS, prefix_attention: str = "auto",
              fast_compile: bool = True, remat: str = "none",
              xla_reductions: bool = True, temp_block_mib: int = 0,
              pack_floor: int | None = None) -> dict:
  import numpy as np  # pylint: disable=import-outside-toplevel
  gen = _rljax_sampler(weights, n, new_tokens, fast_compile)
  t0 = time.perf_counter()
  gen()
  first = time.perf_counter() - t0
  rates = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    n_tok = gen()
    rates.append(n_tok / (time.perf_counter() - t0))
  return {"sampler_first_s": first, "sampler_tokens_per_s": float(np.median(rates)),
          "sampler_tokens": n_tok,
          **_rljax_grpo(weights, steps, fused_mlp, n, new_tokens, prefix_attention,
                        fast_compile, remat, xla_reductions, temp_block_mib, pack_floor)}


def _rljax_sampler(weights: str, n: int = N, new_tokens: int = NEW_TOKENS,
                   fast_compile: bool = True) -> Callable[[], int]:
  """rl_jax's sampler on the prompt: a function that runs one ``rollout.generate(n=n)``
  call (no EOS: ``new_tokens`` tokens per sample) and returns the tokens it sampled."""
  sys.path.insert(0, ROOT)
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from rl_jax import compile_options, models, rollout  # pylint: disable=import-outside-toplevel
  compile_options.use_fast_cpu_compile(fast_compile)  # the sampler's prefill, as in the trainer
  cfg, params = models.load_hf(weights)
  prompt = [list(PROMPT.encode())]

  def gen() -> int:
    out = rollout.generate(cfg, params, prompt, n=n, max_new_tokens=new_tokens,
                           temperature=1.0, eos_id=None, seed=0)
    jax.block_until_ready(out.tokens)
    return int(np.asarray(out.mask).sum())

  return gen


def _rljax_trainer(weights: str, fused_mlp: bool | None = None, n: int = N,
                   new_tokens: int = NEW_TOKENS, prefix_attention: str = "auto",
                   fast_compile: bool = True, remat: str = "none",
                   xla_reductions: bool = True, temp_block_mib: int = 0,
                   pack_floor: int | None = None) -> Callable[[], dict]:
  """rl_jax's GRPO trainer on the prompt: a function that runs one ``train.rl_step`` (to
  the updated parameters) and returns the step's record."""
  sys.path.insert(0, ROOT)
  import dataclasses  # pylint: disable=import-outside-toplevel
  import jax  # pylint: disable=import-outside-toplevel
  from rl_jax import config_utils, train  # pylint: disable=import-outside-toplevel
  from rl_jax.data.base import Example  # pylint: disable=import-outside-toplevel
  config = config_utils.load_config(os.path.join(ROOT, "configs", "quickstart.py"), [
      f"model.hf_path={weights}", "data.tokenizer=char", "sft.steps=0",
      "train.batch_groups=1", f"rollout.n={n}", f"rollout.max_new_tokens={new_tokens}",
      f"rollout.eos_id={EOS}", "rollout.temperature=1.0", "train.eval_every=0",
      "train.compile_cache=", "train.old_logp_pass=auto", "log.tensorboard=False",
      "loss.preset=grpo", "loss.kl_beta=0.0", f"data.max_prompt_len={MAX_PROMPT}",
      f"model.prefix_attention={prefix_attention}",
      # None: rl_jax's default (fused on CPU); True / False only when a flag asks
      *([] if fused_mlp is None else [f"model.fused_mlp={fused_mlp}"]),
      f"train.cpu_fast_compile={fast_compile}", f"train.cpu_xla_reductions={xla_reductions}",
      f"train.cpu_temp_block_mib={temp_block_mib}", "optim.lr=1e-5",  # the peers' learning rate
      *([f"model.remat={remat}"] if remat != "none" else []),
      *([] if pack_floor is None else [f"train.pack_floor={pack_floor}"])])
  s = train.build_setup(config)
  task = type("Task", (), {"split": lambda self, w, n=None: s.task.split(w, n),
                           "verify": lambda self, c, a: _reward(c)})()
  # the peers' prompt every step (not the sorting task's prompts)
  examples = [Example(PROMPT, "")] * len(s.train_examples)
  s = dataclasses.replace(s, task=task, tokenizer=_RljaxBytes(), train_examples=examples,
                          prompt_len=max(s.prompt_len, len(PROMPT.encode()) + 1))
  t = train.make_trainer(s)
  box = [train.begin_rl(s, train.init_state(s))]

  def step() -> dict:
    state, record, data = train.rl_step(t, box[0])
    jax.block_until_ready(state.params)
    box[0] = state._replace(step=state.step + 1, data=jax.numpy.asarray(data))
    return record

  return step


def _rljax_grpo(weights: str, steps: int, fused_mlp: bool | None = None, n: int = N,
                new_tokens: int = NEW_TOKENS, prefix_attention: str = "auto",
                fast_compile: bool = True, remat: str = "none",
                xla_reductions: bool = True, temp_block_mib: int = 0,
                pack_floor: int | None = None) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  step = _rljax_trainer(weights, fused_mlp, n, new_tokens, prefix_attention, fast_compile,
                        remat, xla_reductions, temp_block_mib, pack_floor)
  times, sampled, compiles = [], [], {}

  def compiled(event, duration, fun_name=None, **_):  # the first step's programs
    if event.endswith("backend_compile_duration") and not times and fun_name in FIRST_STEP:
      compiles[fun_name] = compiles.get(fun_name, 0.0) + duration

  jax.monitoring.register_event_duration_secs_listener(compiled)
  for _ in range(steps):
    t0 = time.perf_counter()
    record = step()
    times.append(time.perf_counter() - t0)
    n_tok = record["response_length"] * n  # the step's sampled tokens and their rate
    sampled.append((n_tok / record["rollout_tokens_per_s"], n_tok))
  return {"grpo_first_s": times[0], "grpo_step_s": float(np.median(times[1:])),
          "grpo_worst_s": max(times[1:]), "grpo_steps": len(times),
          "grpo_sampling_s": float(np.median([x for x, _ in sampled[1:]])),
          "grpo_tokens": float(np.median([x for _, x in sampled[1:]])),
          "grpo_first_compile_s": compiles}


class _RljaxBytes:
  """Bytes as tokens for the rl_jax trainer (the same ids the Tunix side uses)."""

  vocab_size, pad_id, eos_id, bos_id = VOCAB, 0, EOS, 1

  def encode(self, text):
    return list(text.encode())

  def decode(self, ids):
    return bytes(i for i in ids if 0 <= i < 256).decode("latin-1")


# ------------------------------------------------------------------------------ Tunix side
class _Bytes:
  """A byte tokenizer with the methods Tunix's TokenizerAdapter asks for."""

  def encode(self, text, **_):
    if not isinstance(text, str):  # the learner may hand over a 0-d / 1-element array
      text = str(__import__("numpy").asarray(text).ravel()[0])
    return list(text.encode())

  def decode(self, ids, **_):
    return bytes(i for i in ids if 0 <= i < 256).decode("latin-1")

  def bos_id(self):
    return 1

  def eos_id(self):
    return EOS

  def pad_id(self):
    return 0


def _tunix_model(weights: str):
  from tunix.models.qwen3 import model as qwen3  # pylint: disable=import-outside-toplevel
  from tunix.models.qwen3 import params as qwen3_params  # pylint: disable=import-outside-toplevel
  cfg = qwen3.ModelConfig(num_layers=LAYERS, vocab_size=VOCAB, embed_dim=HIDDEN,
                          hidden_dim=MLP, num_heads=HEADS, head_dim=HEAD_DIM,
                          num_kv_heads=KV_HEADS, rope_theta=10000, norm_eps=1e-6)
  return cfg, qwen3_params.create_model_from_safe_tensors(weights, cfg)


def run_tunix(weights: str, steps: int, repeats: int, n: int = N,
              new_tokens: int = NEW_TOKENS) -> dict:
  import numpy as np  # pylint: disable=import-outside-toplevel
  gen = _tunix_sampler(weights, n, new_tokens)
  t0 = time.perf_counter()
  gen()
  first = time.perf_counter() - t0
  rates = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    n_tok = gen()
    rates.append(n_tok / (time.perf_counter() - t0))
  return {"sampler_first_s": first, "sampler_tokens_per_s": float(np.median(rates)),
          "sampler_tokens": n_tok, **_tunix_grpo(weights, steps, n, new_tokens)}


def _tunix_sampler(weights: str, n: int = N, new_tokens: int = NEW_TOKENS) -> Callable[[], int]:
  """Tunix's ``Sampler`` on the prompt repeated n times: a function that runs one call (no
  EOS: ``new_tokens`` tokens per sample) and returns the tokens it sampled."""
  from tunix.generate import sampler as sampler_lib  # pylint: disable=import-outside-toplevel
  _, model = _tunix_model(weights)
  sampler = sampler_lib.Sampler(model, _Bytes(), sampler_lib.CacheConfig(
      cache_size=context(new_tokens), num_layers=LAYERS, num_kv_heads=KV_HEADS,
      head_dim=HEAD_DIM))

  def gen() -> int:
    out = sampler([PROMPT] * n, max_generation_steps=new_tokens, temperature=1.0,
                  eos_tokens=[NEVER], seed=0, max_prompt_length=MAX_PROMPT)
    return sum(len(t) for t in out.tokens)

  return gen


def _tunix_grpo(weights: str, steps: int, n: int = N, new_tokens: int = NEW_TOKENS) -> dict:
  import numpy as np  # pylint: disable=import-outside-toplevel
  calls = []
  learner, data = _tunix_learner(weights, steps, n, new_tokens,
                                 lambda: calls.append(time.perf_counter()))
  start = time.perf_counter()
  learner.train(data)
  end = time.perf_counter()
  marks = [start] + calls[1:] + [end]  # step i ends when step i+1's rewards are computed
  steps_s = [b - a for a, b in zip(marks[:-1], marks[1:])]
  return {"grpo_first_s": steps_s[0], "grpo_step_s": float(np.median(steps_s[1:])),
          "grpo_worst_s": max(steps_s[1:]), "grpo_steps": len(calls)}


def _tunix_learner(weights: str, steps: int, n: int, new_tokens: int,
                   on_reward: Callable[[], None]):
  """Tunix's ``GRPOLearner`` on the prompt (num_generations n, beta 0, one minibatch) and
  ``steps`` batches of it for ``learner.train``; ``on_reward()`` is called first thing in
  every step's reward call (the step's rollout is done, its update not begun)."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import optax  # pylint: disable=import-outside-toplevel
  from tunix.rl import rl_cluster as rl_cluster_lib  # pylint: disable=import-outside-toplevel
  from tunix.rl.grpo import grpo_learner  # pylint: disable=import-outside-toplevel
  from tunix.rl.rollout import base_rollout  # pylint: disable=import-outside-toplevel
  _, actor = _tunix_model(weights)
  mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  roles = rl_cluster_lib.Role
  cluster_config = rl_cluster_lib.ClusterConfig(
      role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh},
      rollout_engine="vanilla", offload_to_cpu=False,
      training_config=rl_cluster_lib.RLTrainingConfig(
          actor_optimizer=optax.adamw(1e-5), eval_every_n_steps=10**9, max_steps=steps,
          mini_batch_size=1, train_micro_batch_size=1, rollout_micro_batch_size=1,
          compute_logps_micro_batch_size=1),
      rollout_config=base_rollout.RolloutConfig(
          max_tokens_to_generate=new_tokens, max_prompt_length=MAX_PROMPT,
          kv_cache_size=context(new_tokens),
          temperature=1.0, top_p=1.0, top_k=None))
  cluster = rl_cluster_lib.RLCluster(actor=actor, reference=None, tokenizer=_Bytes(),
                                     cluster_config=cluster_config)

  def reward(prompts, completions, **_):
    on_reward()
    return [_reward(c) for c in completions]

  learner = grpo_learner.GRPOLearner(
      rl_cluster=cluster, reward_fns=[reward],
      algo_config=grpo_learner.GRPOConfig(num_generations=n, num_iterations=1, beta=0.0))
  return learner, [{"prompts": np.array([PROMPT])} for _ in range(steps)]


def report_lockstep(results: dict, args) -> dict:
  """Prints ``lockstep``'s pairs: each side's median, then the per-pair ratios (rl_jax's
  sampler tokens/s over Tunix's, Tunix's GRPO step time over rl_jax's), median and worst,
  and the same over blocks of ``BLOCK`` pairs (each block's median ratio)."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  sample, step = results["sample"], results["step"]
  rate = lambda a: a["tokens"] / a["s"]
  ratios = {"sampler": [rate(a) / rate(b) for a, b in zip(sample["rljax"], sample["tunix"])],
            "GRPO step": [b["s"] / a["s"] for a, b in zip(step["rljax"], step["tunix"])]}
  print(f"load average {os.getloadavg()[0]:.1f}; lockstep, {args.lockstep} pairs; 1 prompt of "
        f"{args.prompt_tokens} tokens, {args.samples} samples x {args.new_tokens} new tokens; "
        f"rl_jax fused_mlp={'default' if args.fused_mlp is None else args.fused_mlp}, "
        f"prefix_attention={args.prefix_attention}, cpu_fast_compile={args.fast_compile}, remat={args.remat}, "
        f"cpu_xla_reductions={args.xla_reductions}, cpu_temp_block_mib={args.temp_block_mib}")
  print("| side | sampler tokens/s, median | GRPO step (s), median | GRPO step (s), worst |")
  print("|---|---|---|---|")
  for side in ("rljax", "tunix"):
    times = [a["s"] for a in step[side]]
    print(f"| {side} | {np.median([rate(a) for a in sample[side]]):.3g} | "
          f"{np.median(times):.3g} | {max(times):.3g} |")
  print("per pair: " + "; ".join(f"{k} {np.median(v):.2f}x median, {min(v):.2f}x worst"
                                 for k, v in ratios.items()))
  # the median pair ratio of each block of BLOCK pairs: as many timed calls as a round's
  blocks = {k: [float(np.median(v[i:i + BLOCK])) for i in range(0, len(v) - BLOCK + 1, BLOCK)]
            for k, v in ratios.items()}
  if all(blocks.values()):
    print(f"per block of {BLOCK} pairs: " + "; ".join(
        f"{k} {np.median(v):.2f}x median, {min(v):.2f}x worst" for k, v in blocks.items()))
  return {**results, "ratios": ratios, "blocks": blocks}


# ---------------------------------------------------------------------------------- driver
def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tunix-python", default="/work/venvs/tunix/bin/python")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--steps", type=int, default=6, help="GRPO steps per side and round")
  ap.add_argument("--repeats", type=int, default=5, help="timed sampler calls")
  ap.add_argument("--fused-mlp", action=argparse.BooleanOptionalAction, default=None,
                  help="rl_jax trainer: model.fused_mlp (default: rl_jax's, fused on CPU)")
  ap.add_argument("--prefix-attention", choices=("auto", "kernel", "concat"), default="auto",
                  help="rl_jax trainer: model.prefix_attention")
  ap.add_argument("--fast-compile", action=argparse.BooleanOptionalAction, default=True,
                  help="rl_jax trainer: train.cpu_fast_compile (rl_jax's default: on)")
  ap.add_argument("--xla-reductions", action=argparse.BooleanOptionalAction, default=True,
                  help="rl_jax trainer: train.cpu_xla_reductions (rl_jax's default: on)")
  ap.add_argument("--temp-block-mib", type=int, default=0,
                  help="rl_jax trainer: train.cpu_temp_block_mib (rl_jax's default: 0, off)")
  ap.add_argument("--host-heap-reuse", choices=("none", "rljax", "both"), default="none",
                  help="reuse_large_blocks() first in these sides' processes")
  ap.add_argument("--reuse-heap", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--pack-floor", type=int, default=None,
                  help="rl_jax's train.pack_floor (default: rl_jax's)")
  ap.add_argument("--remat", choices=("none", "full", "dots"), default="none",
                  help="rl_jax trainer: model.remat")
  ap.add_argument("--samples", type=int, default=N, help="samples of the one prompt")
  ap.add_argument("--new-tokens", type=int, default=NEW_TOKENS,
                  help="new tokens per sample (sampler: exactly; GRPO: at most)")
  ap.add_argument("--prompt-tokens", type=int, default=len(PROMPT) + 1,
                  help="tokens of the one shared prompt, BOS included (default: the 9-byte "
                       "question)")
  ap.add_argument("--lockstep", type=int, default=0, metavar="PAIRS",
                  help="instead of --rounds: both sides' processes up at once, taking turns "
                       "over PAIRS sampler calls and PAIRS GRPO steps (after one and two "
                       "untimed ones); --steps and --repeats are not used")
  ap.add_argument("--side", choices=("rljax", "tunix"), default=None, help=argparse.SUPPRESS)
  ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--weights", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  set_prompt_tokens(args.prompt_tokens)
  if args.side:  # a child process: one side, result as JSON on the last line
    if args.reuse_heap:  # before the process's first JAX computation
      reuse_large_blocks()
    if args.serve and args.side == "rljax":
      serve_rljax(args.weights, args.samples, args.new_tokens, args.fast_compile,
                  fused_mlp=args.fused_mlp, prefix_attention=args.prefix_attention,
                  remat=args.remat, xla_reductions=args.xla_reductions,
                  temp_block_mib=args.temp_block_mib, pack_floor=args.pack_floor)
    elif args.serve:
      serve_tunix(args.weights, args.samples, args.new_tokens)
    elif args.side == "rljax":
      print(json.dumps(run_rljax(args.weights, args.steps, args.repeats, args.fused_mlp,
                                 args.samples, args.new_tokens, args.prefix_attention,
                                 args.fast_compile, args.remat, args.xla_reductions,
                                 args.temp_block_mib, args.pack_floor)))
    else:
      print(json.dumps(run_tunix(args.weights, args.steps, args.repeats, args.samples,
                                 args.new_tokens)))
    return {}
  def command(side: str, weights: str) -> list[str]:
    python = sys.executable if side == "rljax" else args.tunix_python
    cmd = [python, os.path.abspath(__file__), "--side", side, "--weights", weights,
           "--steps", str(args.steps), "--repeats", str(args.repeats),
           "--samples", str(args.samples), "--new-tokens", str(args.new_tokens),
           "--prompt-tokens", str(args.prompt_tokens)]
    if args.fused_mlp is not None and side == "rljax":
      cmd += ["--fused-mlp" if args.fused_mlp else "--no-fused-mlp"]
    if side == "rljax":
      cmd += ["--fast-compile" if args.fast_compile else "--no-fast-compile",
              "--xla-reductions" if args.xla_reductions else "--no-xla-reductions",
              "--temp-block-mib", str(args.temp_block_mib)]
      cmd += [] if args.pack_floor is None else ["--pack-floor", str(args.pack_floor)]
    cmd += ["--reuse-heap"] if args.host_heap_reuse in ("both", side) else []
    cmd += ["--prefix-attention", args.prefix_attention, "--remat", args.remat
            ] if side == "rljax" else []
    return cmd + (["--serve"] if args.lockstep else [])

  if args.lockstep:
    return report_lockstep(lockstep(args.lockstep, ("rljax", "tunix"), args.new_tokens,
                                     command, {"sample": 1, "step": 2}), args)
  results = alternate_sides(args.rounds, ("rljax", "tunix"), args.new_tokens, command)
  print(f"load average {os.getloadavg()[0]:.1f}; 1 prompt of {args.prompt_tokens} tokens, "
        f"{args.samples} samples x "
        f"{args.new_tokens} new tokens; rl_jax fused_mlp="
        f"{'default' if args.fused_mlp is None else args.fused_mlp}, "
        f"prefix_attention={args.prefix_attention}, cpu_fast_compile={args.fast_compile}, "
        f"remat={args.remat}, cpu_xla_reductions={args.xla_reductions}, "
        f"cpu_temp_block_mib={args.temp_block_mib}, host_heap_reuse={args.host_heap_reuse}, "
        f"pack_floor={'default' if args.pack_floor is None else args.pack_floor}")
  med = lambda side, k: float(np.median([x[k] for x in results[side]]))
  keys = ("sampler_tokens_per_s", "sampler_first_s", "grpo_step_s", "grpo_worst_s",
          "grpo_first_s")
  print("| side | sampler tokens/s | sampler warm-up (s) | GRPO step (s) | worst GRPO step (s) "
        "| first GRPO step (s) |")
  print("|---|---|---|---|---|---|")
  for side in results:
    print(f"| {side} | " + " | ".join(f"{med(side, k):.3g}" for k in keys) + " |")
  print(f"rl_jax / Tunix: sampler {med('rljax', keys[0]) / med('tunix', keys[0]):.2f}x "
        f"tokens/s, GRPO step {med('tunix', keys[2]) / med('rljax', keys[2]):.2f}x faster")
  ratio = lambda k, i, j: [results[i][r][k] / results[j][r][k] for r in range(args.rounds)]
  sampler, step = ratio(keys[0], "rljax", "tunix"), ratio(keys[2], "tunix", "rljax")
  print("| round | " + " | ".join(f"{side} {k}" for k in keys for side in results) + " |")
  print("|---" * (1 + len(keys) * len(results)) + "|")
  for r in range(args.rounds):
    print(f"| {r + 1} | " + " | ".join(f"{results[side][r][k]:.3g}" for k in keys
                                       for side in results) + " |")
  for r, a in enumerate(results["rljax"]):
    if "grpo_sampling_s" in a:
      print(f"round {r + 1}: rl_jax sampling inside its GRPO step {a['grpo_sampling_s']:.2f} s, "
            f"{a['grpo_tokens']:.0f} tokens per step; first step's backend compiles: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in a.get("grpo_first_compile_s", {}).items()))
  print(f"per round: sampler {np.median(sampler):.2f}x median, {min(sampler):.2f}x worst; "
        f"GRPO step {np.median(step):.2f}x median, {min(step):.2f}x worst")
  return results


if __name__ == "__main__":
  main()
