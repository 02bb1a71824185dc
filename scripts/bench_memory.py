"""Memory of a real-sized run, measured against the memory plan; and plans for larger models.

    python scripts/bench_memory.py measure [--workdir /tmp/bench_memory] [--extra KEY=V ...]
    python scripts/bench_memory.py predict [--workdir /tmp/bench_memory_predict]
    python scripts/bench_memory.py knobs [--workdir /tmp/bench_memory_knobs] [--only LABEL ...]

``measure`` writes a Qwen3-0.6B-shaped checkpoint (596M parameters, random bf16 weights,
vocabulary 151,936, tied embeddings), a small BPE tokenizer.json and a GSM8K-format JSONL
file, then trains ``configs/gsm8k_hf.py`` for 3 steps at 2 groups x 4 samples x 32 new
tokens under ``/usr/bin/time -v`` and prints the peak resident set size next to the plan's
numbers (``memory_plan.json``: predicted state bytes, the state's live bytes, the predicted
peak). ``--extra`` adds config overrides (a memory knob, e.g. ``optim.mu_dtype=bfloat16``).

``predict`` writes config.json + tokenizer only (no weights: the dry run reads none) for
Qwen3-1.7B / 4B / 8B and prints each one's plan (``train.dry_run``) for ``configs/gsm8k_hf.py``
at its defaults on 8 fake CPU devices (the layout of a TPU v5e-8 / v4-8 slice, FSDP over 8
chips) and on 1 device (one 80 GB GPU). The programs are compiled for the CPU backend: the
numbers are XLA's memory analysis of those programs, predicted, not run on that hardware.

``knobs`` prints the plan (dry run, one CPU device) of the ``measure`` run under each memory
knob (``KNOB_ROWS``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30

# (hidden, intermediate, layers, heads, kv heads, tied) of the Qwen3 family (head dim 128)
SHAPES = {"qwen3-0.6b": (1024, 3072, 28, 16, 8, True), "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
          "qwen3-4b": (2560, 9728, 36, 32, 8, True), "qwen3-8b": (4096, 12288, 36, 32, 8, False)}
VOCAB = 151936
QUESTIONS = [("Tom has {a} apples and buys {b} more. How many apples?", "{a} + {b} = {c}\n#### {c}")]
RUN = ["train.steps=3", "train.batch_groups=2", "rollout.n=4", "rollout.max_new_tokens=32",
       "train.minibatches=1", "train.eval_every=0", "log.tensorboard=False"]


def write_config(path: str, name: str) -> None:
  hidden, inter, layers, heads, kv, tied = SHAPES[name]
  cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB,
         "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
         "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": 128,
         "max_position_embeddings": 40960, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
         "tie_word_embeddings": tied, "attention_bias": False, "hidden_act": "silu",
         "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(cfg, f, indent=1)


def write_tokenizer(path: str, texts: list[str]) -> None:
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import models, pre_tokenizers, trainers  # pylint: disable=import-outside-toplevel
  tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=400, special_tokens=["<pad>", "<unk>", "</s>"],
      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "</s>", "pad_token": "<pad>"}, f)


def write_data(path: str) -> list[str]:
  texts = []
  with open(path, "w") as f:
    for i in range(64):
      a, b = i % 17 + 2, i % 11 + 3
      q, ans = (x.format(a=a, b=b, c=a + b) for x in QUESTIONS[0])
      f.write(json.dumps({"question": q, "answer": ans}) + "\n")
      texts.append(q + " " + ans)
  return texts


def write_weights(path: str, name: str, seed: int = 0) -> int:
  """Random bf16 weights under the HF names (0.02 normal; norms 1); returns the count."""
  import torch  # pylint: disable=import-outside-toplevel
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  hidden, inter, layers, heads, kv, tied = SHAPES[name]
  g = torch.Generator().manual_seed(seed)
  rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
  ones = lambda n: torch.ones(n, dtype=torch.bfloat16)
  t = {"model.embed_tokens.weight": rand(VOCAB, hidden), "model.norm.weight": ones(hidden)}
  if not tied:
    t["lm_head.weight"] = rand(VOCAB, hidden)
  for i in range(layers):
    p = f"model.layers.{i}."
    t.update({p + "self_attn.q_proj.weight": rand(heads * 128, hidden),
              p + "self_attn.k_proj.weight": rand(kv * 128, hidden),
              p + "self_attn.v_proj.weight": rand(kv * 128, hidden),
              p + "self_attn.o_proj.weight": rand(hidden, heads * 128),
              p + "self_attn.q_norm.weight": ones(128), p + "self_attn.k_norm.weight": ones(128),
              p + "mlp.gate_proj.weight": rand(inter, hidden),
              p + "mlp.up_proj.weight": rand(inter, hidden),
              p + "mlp.down_proj.weight": rand(hidden, inter),
              p + "input_layernorm.weight": ones(hidden),
              p + "post_attention_layernorm.weight": ones(hidden)})
  save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  return sum(x.numel() for x in t.values())


def prepare(workdir: str, name: str, weights: bool) -> tuple[str, str]:
  model, data = os.path.join(workdir, name), os.path.join(workdir, "gsm8k.jsonl")
  os.makedirs(model, exist_ok=True)
  texts = write_data(data)
  write_config(model, name)
  write_tokenizer(model, texts)
  if weights and not os.path.exists(os.path.join(model, "model.safetensors")):
    print(f"{name}: {write_weights(model, name) / 1e6:.0f}M parameters written", flush=True)
  return model, data


def _cmd(model: str, data: str, run: str, overrides: list[str]) -> list[str]:
  cmd = [sys.executable, "-m", "rl_jax.train", f"--config={ROOT}/configs/gsm8k_hf.py",
         f"--workdir={run}", f"--config.model.hf_path={model}", f"--config.data.path={data}"]
  return cmd + [f"--config.{o}" for o in overrides]


def _gib(n: float) -> str:
  return f"{n / GiB:.2f} GiB"


def measure(args) -> None:
  model, data = prepare(args.workdir, "qwen3-0.6b", weights=True)
  run = os.path.join(args.workdir, "run")
  subprocess.run(["rm", "-rf", run], check=True)
  cmd = ["/usr/bin/time", "-v"] + _cmd(model, data, run, RUN + list(args.extra))
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if out.returncode:
    sys.exit(out.stderr[-3000:])
  rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", out.stderr).group(1))
  wall = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", out.stderr).group(1)
  plan = json.load(open(os.path.join(run, "memory_plan.json")))
  rows = [r for r in map(json.loads, open(os.path.join(run, "metrics.jsonl")))]
  rl = plan["state"]["rl"]
  live = {k: v for k, v in plan["live_state"].items() if k != "step"}
  result = {
      "overrides": list(args.extra), "peak_rss": rss_kb * 1024, "wall": wall,
      "state_predicted": sum(rl.values()), "state_live": sum(live.values()),
      "state_exact": all(live[k] == rl[k] for k in live),
      "parts": rl, "steps": {k: v.get("extra", 0) for k, v in plan["steps"].items()},
      "peak_predicted": plan["peak"]["rl"],
      "mismatch_max": max(r.get("mismatch_max", 0.0) for r in rows),
      "reward_mean": [r.get("reward_mean") for r in rows]}
  print(json.dumps(result, indent=1))
  print(f"peak RSS {_gib(result['peak_rss'])} (wall {wall}); plan: state "
        f"{_gib(result['state_predicted'])} (live {_gib(result['state_live'])}, exact: "
        f"{result['state_exact']}), predicted device peak {_gib(result['peak_predicted'])}; "
        f"mismatch_max {result['mismatch_max']:.4f}")


def predict(args) -> None:
  hardware = {"TPU v5e-8 (16 GiB/chip)": (8, 16 * GiB), "TPU v4-8 (32 GiB/chip)": (8, 32 * GiB),
              "1x 80 GB GPU": (1, 80 * 10**9)}
  for name in args.models:
    model, data = prepare(args.workdir, name, weights=False)
    plans = {}
    for devices in sorted({d for d, _ in hardware.values()}):
      run = os.path.join(args.workdir, f"run-{name}-{devices}")
      env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
      out = subprocess.run(_cmd(model, data, run, ["train.dry_run=True"]), cwd=ROOT, env=env,
                           capture_output=True, text=True)
      if out.returncode:
        sys.exit(out.stderr[-3000:])
      plans[devices] = json.load(open(os.path.join(run, "memory_plan.json")))
    for hw, (devices, capacity) in hardware.items():
      p = plans[devices]
      rl = p["state"]["rl"]
      steps = {k: v.get("extra", 0) for k, v in p["steps"].items()}
      print(f"| {name} | {hw} | {_gib(rl['policy'])} | {_gib(rl['rl_optimizer'])} | "
            f"{_gib(rl['reference'])} | {_gib(max(steps.values()))} | "
            f"{_gib(p['peak']['rl'])} | {'yes' if p['peak']['rl'] <= capacity else 'no'} |",
            flush=True)


KNOB_ROWS = {"defaults": [], "optim.mu_dtype=bfloat16": ["optim.mu_dtype=bfloat16"],
             "train.ref_dtype=float32 (the old reference)": ["train.ref_dtype=float32"],
             "model.remat=dots (default full)": ["model.remat=dots"],
             "model.param_dtype=bfloat16": ["model.param_dtype=bfloat16"],
             "model.param_dtype=bfloat16 + optim.stochastic_rounding": [
                 "model.param_dtype=bfloat16", "optim.stochastic_rounding=True"],
             "optim.grad_clip=0 (no clipping: another optimizer)": ["optim.grad_clip=0"],
             "train.offload=reference": ["train.offload=reference"],
             "train.offload=optimizer": ["train.offload=optimizer"],
             "train.offload=reference,optimizer": ["train.offload=reference,optimizer"]}


def knobs(args) -> None:
  """The plan of the measured 0.6B run (one CPU device) under each memory knob: bytes in
  device memory, in host memory (``train.offload``), the largest step addition, the device
  peak an accelerator would see (device state + largest step addition; the CPU plan's own
  peak also counts host memory, the same RAM there) and the RL update's staged bytes."""
  model, data = prepare(args.workdir, "qwen3-0.6b", weights=False)
  for label, extra in KNOB_ROWS.items():
    if args.only and not any(o in label for o in args.only):
      continue
    run = os.path.join(args.workdir, "knob-run")
    subprocess.run(["rm", "-rf", run], check=True)
    out = subprocess.run(_cmd(model, data, run, RUN + extra + ["train.dry_run=True"]), cwd=ROOT,
                         capture_output=True, text=True)
    if out.returncode:
      sys.exit(out.stderr[-3000:])
    p = json.load(open(os.path.join(run, "memory_plan.json")))
    rl, host = p["state"]["rl"], p["host_state"]["rl"]
    extra_max = max(v.get("extra", 0) for v in p["steps"].values())
    print(f"| {label} | {_gib(sum(rl.values()))} | {_gib(sum(host.values()))} | "
          f"{_gib(rl['rl_optimizer'] + host['rl_optimizer'])} | "
          f"{_gib(rl['reference'] + host['reference'])} | "
          f"{_gib(p['steps']['rl_update']['extra'])} | {_gib(sum(rl.values()) + extra_max)} |",
          flush=True)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="mode", required=True)
  m = sub.add_parser("measure")
  m.add_argument("--workdir", default="/tmp/bench_memory")
  m.add_argument("--extra", nargs="*", default=[])
  p = sub.add_parser("predict")
  p.add_argument("--workdir", default="/tmp/bench_memory_predict")
  p.add_argument("--models", nargs="*", default=["qwen3-1.7b", "qwen3-4b", "qwen3-8b"])
  k = sub.add_parser("knobs")
  k.add_argument("--workdir", default="/tmp/bench_memory_knobs")
  k.add_argument("--only", nargs="*", default=[], help="rows whose label contains one of these")
  args = ap.parse_args()
  {"measure": measure, "predict": predict, "knobs": knobs}[args.mode](args)


if __name__ == "__main__":
  main()
