"""rl_jax vs TRL side by side: one GRPO step and sampling tokens/s on the same weights.

The weights, workload and rl_jax side are ``bench_tunix.py``'s: random Qwen3-style weights
(hidden 256, 4 layers, 4 query / 2 KV heads of 64, MLP 896, 256-symbol byte vocabulary: 3.7M
parameters) written once with ``models.save_hf``; 1 prompt x 16 samples (``--samples``), at
most 64 new tokens (``--new-tokens``), temperature 1.0, float32; the 9-byte prompt or, with
``--prompt-tokens N``, ``bench_tunix.py``'s longer shared prompt.

* GRPO step: rl_jax ``train.rl_step`` at rl_jax's defaults (``old_logp_pass=auto``, GRPO,
  β = 0; ``--[no-]fused-mlp`` sets ``model.fused_mlp``, ``--prefix-attention``
  ``model.prefix_attention``) vs TRL's
  ``GRPOTrainer`` (``Qwen3ForCausalLM`` loaded from the same directory; num_generations 16,
  batch 16, β = 0, ``loss_type="grpo"``, one iteration, no gradient checkpointing, CPU);
  the same prompt every step, both stop a sample at EOS id 255. TRL's step is the wall
  time between its ``on_step_begin`` and ``on_step_end`` callbacks (sampling, rewards, loss,
  backward, optimizer); the step's sampling time and sampled tokens are taken from the
  trainer's own ``_generate`` call. Step 1 (warm-up) is excluded: median and worst of
  steps 2..``--steps``.
* sampling: rl_jax ``rollout.generate(n=16)`` vs transformers ``generate`` (what
  GRPOTrainer samples with) on the prompt x 16, ``do_sample=True``, exactly 64 (``--new-tokens``)
  new tokens, no EOS;
  tokens/s, median of ``--repeats`` calls after a warm-up call.

PyTorch runs with ``--torch-threads`` intra-op threads (default 1). On a shared 2-core
machine two OpenMP threads made every small matmul of transformers' decode wait on a
descheduled peer (10-20x slower generate under load), which is what made an earlier TRL step
time implausible; one thread is the faster setting there, so it is the one compared.

Each side runs in its own process: TRL in ``--trl-python``'s virtual environment (``pip
install trl torch``, CPU build), so it cannot change this one's packages. The sides
alternate over ``--rounds``; every round's numbers are printed, then the median and worst
per-round ratios.

Usage::

    python3 -m venv /work/venvs/trl && /work/venvs/trl/bin/pip install trl torch
    python scripts/bench_trl.py --trl-python /work/venvs/trl/bin/python --rounds 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_tunix as shared  # noqa: E402  (weights, workload, rounds, the rl_jax side)


def _byte_tokenizer():
  """A transformers tokenizer whose ids are the prompt's bytes (the rl_jax side's ids)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  vocab = {chr(i): i for i in range(shared.VOCAB)}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.decoder = tokenizers.decoders.Fuse()
  return transformers.PreTrainedTokenizerFast(
      tokenizer_object=tok, eos_token=chr(shared.EOS), pad_token=chr(0), bos_token=chr(1))


def run_trl(weights: str, steps: int, repeats: int, threads: int = 1, n: int = shared.N,
            new_tokens: int = shared.NEW_TOKENS) -> dict:
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  torch.set_num_threads(threads)
  tokenizer = _byte_tokenizer()
  model = transformers.AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
  ids = torch.tensor([list(shared.PROMPT.encode())] * n)

  def gen():
    with torch.no_grad():
      return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True,
                            temperature=1.0, top_k=0, top_p=1.0,
                            max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                            eos_token_id=None, pad_token_id=0)

  t0 = time.perf_counter()
  gen()
  first = time.perf_counter() - t0
  rates = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    out = gen()
    rates.append((out.shape[1] - ids.shape[1]) * n / (time.perf_counter() - t0))
  return {"sampler_first_s": first, "sampler_tokens_per_s": float(np.median(rates)),
          "torch_threads": torch.get_num_threads(),
          **_trl_grpo(weights, tokenizer, steps, n, new_tokens)}


def _trl_grpo(weights: str, tokenizer, steps: int, n: int = shared.N,
              new_tokens: int = shared.NEW_TOKENS) -> dict:
  import datasets  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  import trl  # pylint: disable=import-outside-toplevel

  marks, sampled = [], []

  class Clock(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, **kw):
      marks.append(("begin", time.perf_counter()))

    def on_step_end(self, args, state, control, **kw):
      marks.append(("end", time.perf_counter()))

  def reward(completions, **_):
    return [shared._reward(c) for c in completions]  # pylint: disable=protected-access

  with tempfile.TemporaryDirectory() as out:
    config = trl.GRPOConfig(
        output_dir=out, use_cpu=True, bf16=False, fp16=False, report_to="none",
        per_device_train_batch_size=n, num_generations=n,
        max_completion_length=new_tokens, temperature=1.0, top_k=0, top_p=1.0,
        beta=0.0, loss_type="grpo", num_iterations=1, gradient_checkpointing=False,
        learning_rate=1e-5, max_steps=steps, logging_steps=10**6, save_strategy="no",
        shuffle_dataset=False, dataloader_num_workers=0, seed=0)
    trainer = trl.GRPOTrainer(
        model=weights, reward_funcs=[reward], args=config, processing_class=tokenizer,
        train_dataset=datasets.Dataset.from_dict({"prompt": [shared.PROMPT] * steps}),
        callbacks=[Clock()])
    generate = trainer._generate  # pylint: disable=protected-access

    def timed_generate(*a, **k):
      t0 = time.perf_counter()
      res = generate(*a, **k)
      sampled.append((time.perf_counter() - t0, sum(len(c) for c in res[1])))
      return res

    trainer._generate = timed_generate  # pylint: disable=protected-access
    trainer.train()
  return step_summary(marks, sampled)


def step_summary(marks, sampled) -> dict:
  """TRL's step times from the (kind, time) callback marks, step 1 excluded: first, median,
  worst (s), and the median sampling time (s) and sampled tokens inside a step."""
  begins = [t for k, t in marks if k == "begin"]
  ends = [t for k, t in marks if k == "end"]
  if len(begins) != len(ends) or len(begins) != len(sampled) or len(begins) < 2:
    raise RuntimeError(f"{len(begins)} step begins, {len(ends)} ends, {len(sampled)} "
                       "samplings: not one sampling per step")
  step_s = [b - a for a, b in zip(begins, ends)]
  return {"grpo_first_s": step_s[0], "grpo_step_s": float(np.median(step_s[1:])),
          "grpo_worst_s": max(step_s[1:]), "grpo_steps": len(step_s),
          "grpo_sampling_s": float(np.median([s for s, _ in sampled[1:]])),
          "grpo_tokens": float(np.median([n for _, n in sampled[1:]]))}


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--trl-python", default="/work/venvs/trl/bin/python")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--steps", type=int, default=5, help="GRPO steps per side and round")
  ap.add_argument("--repeats", type=int, default=3, help="timed sampler calls")
  ap.add_argument("--torch-threads", type=int, default=1, help="PyTorch intra-op threads")
  ap.add_argument("--fused-mlp", action=argparse.BooleanOptionalAction, default=None,
                  help="rl_jax trainer: model.fused_mlp (default: rl_jax's, fused on CPU)")
  ap.add_argument("--prefix-attention", choices=("auto", "kernel", "concat"), default="auto",
                  help="rl_jax trainer: model.prefix_attention")
  ap.add_argument("--samples", type=int, default=shared.N, help="samples of the one prompt")
  ap.add_argument("--new-tokens", type=int, default=shared.NEW_TOKENS,
                  help="new tokens per sample (sampling: exactly; GRPO: at most)")
  ap.add_argument("--prompt-tokens", type=int, default=len(shared.PROMPT) + 1,
                  help="tokens of the one shared prompt, BOS included (default: the 9-byte "
                       "question); TRL's byte tokenizer adds no BOS, so its prompt is one "
                       "token shorter")
  ap.add_argument("--side", choices=("rljax", "trl"), default=None, help=argparse.SUPPRESS)
  ap.add_argument("--weights", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  shared.set_prompt_tokens(args.prompt_tokens)
  if args.side == "rljax":  # a child process: one side, result as JSON on the last line
    print(json.dumps(shared.run_rljax(args.weights, args.steps, args.repeats, args.fused_mlp,
                                      args.samples, args.new_tokens, args.prefix_attention)))
    return {}
  if args.side == "trl":
    print(json.dumps(run_trl(args.weights, args.steps, args.repeats, args.torch_threads,
                             args.samples, args.new_tokens)))
    return {}
  def command(side: str, weights: str) -> list[str]:
    python = sys.executable if side == "rljax" else args.trl_python
    cmd = [python, os.path.abspath(__file__), "--side", side, "--weights", weights,
           "--steps", str(args.steps), "--repeats", str(args.repeats),
           "--torch-threads", str(args.torch_threads), "--samples", str(args.samples),
           "--new-tokens", str(args.new_tokens), "--prompt-tokens", str(args.prompt_tokens)]
    if args.fused_mlp is not None and side == "rljax":
      cmd += ["--fused-mlp" if args.fused_mlp else "--no-fused-mlp"]
    cmd += ["--prefix-attention", args.prefix_attention] if side == "rljax" else []
    return cmd

  results = shared.alternate_sides(args.rounds, ("rljax", "trl"), args.new_tokens, command)
  print(f"load average {os.getloadavg()[0]:.1f}; torch threads {args.torch_threads}; "
        f"1 prompt of {args.prompt_tokens} tokens, {args.samples} samples x {args.new_tokens} new tokens; rl_jax fused_mlp="
        f"{'default' if args.fused_mlp is None else args.fused_mlp}, prefix_attention={args.prefix_attention}")
  print(report(results))
  return results


def report(results: dict) -> str:
  """Markdown rows per round and the median / worst per-round ratios (rl_jax over TRL)."""
  lines = ["| round | rl_jax sampler tok/s | transformers generate tok/s | rl_jax GRPO step "
           "(s), median / worst | TRL GRPO step (s), median / worst | sampling inside the "
           "step (s), rl_jax / TRL | tokens per step, rl_jax / TRL | rl_jax first GRPO step "
           "(s) | TRL first GRPO step (s) |", "|---|---|---|---|---|---|---|---|---|"]
  rounds = list(zip(results["rljax"], results["trl"]))
  for r, (a, b) in enumerate(rounds):
    worst_a = a.get("grpo_worst_s", a["grpo_step_s"])
    sampling_a = f"{a['grpo_sampling_s']:.2f}" if "grpo_sampling_s" in a else "–"
    tokens_a = f"{a['grpo_tokens']:.0f}" if "grpo_tokens" in a else "–"
    lines.append(
        f"| {r + 1} | {a['sampler_tokens_per_s']:.0f} | {b['sampler_tokens_per_s']:.0f} | "
        f"{a['grpo_step_s']:.2f} / {worst_a:.2f} | {b['grpo_step_s']:.2f} / "
        f"{b['grpo_worst_s']:.2f} | {sampling_a} / {b['grpo_sampling_s']:.2f} | {tokens_a} / "
        f"{b['grpo_tokens']:.0f} | "
        f"{a['grpo_first_s']:.1f} | {b['grpo_first_s']:.1f} |")
  sampler = [a["sampler_tokens_per_s"] / b["sampler_tokens_per_s"] for a, b in rounds]
  step = [b["grpo_step_s"] / a["grpo_step_s"] for a, b in rounds]
  lines.append(f"rl_jax / TRL per round: sampler {np.median(sampler):.2f}x median, "
               f"{min(sampler):.2f}x worst; GRPO step {np.median(step):.2f}x faster median, "
               f"{min(step):.2f}x worst")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
