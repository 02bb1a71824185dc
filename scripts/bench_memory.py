"""Memory of a real-sized run, measured against the memory plan; and plans for larger models.

    python scripts/bench_memory.py measure [--workdir /tmp/bench_memory] [--extra KEY=V ...]
    python scripts/bench_memory.py predict [--workdir /tmp/bench_memory_predict] [--models M ...]
        [--devices 1 8] [--extra KEY=V ...]
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
chips) and on 1 device (one 80 GB GPU); ``--devices 1`` keeps one of them, ``--extra`` adds
config overrides (``train.micro_batches=8``). The programs are compiled for the CPU backend: the
numbers are XLA's memory analysis of those programs, predicted, not run on that hardware.

``knobs`` prints the plan (dry run, one CPU device) of the ``measure`` run under each memory
knob (``KNOB_ROWS``).

    python scripts/bench_memory.py lora --model qwen3-1.7b --lora-rank 16 --full-plan
    python scripts/bench_memory.py lora --model qwen3-4b --lora-rank 16 --lora-quant int4 --steps 1

``lora`` writes a Qwen3-1.7B / 4B-shaped random bf16 checkpoint (HF names, sharded
safetensors, written layer by layer in a separate process so its own memory stays out of the
measurement), then: with ``--full-plan`` the full fine-tuning dry run of the same batch
(``configs/gsm8k_hf.py``: float32 master weights) and its one-line verdict against the
host's capacity (``memory.check_plan_fits``, the check a real run makes before its first
step); the dry run of the LoRA run; and the LoRA run itself (``model.lora.rank``, the frozen
base in the bf16 compute dtype and the adapters in float32, optionally ``model.lora.quant``; k3
KL with β = 0.001, ``sft.steps=0``, 2 groups x 4 samples x 32 new tokens, ``--steps`` GRPO
steps). The run's peak RSS is the kernel's: ``VmHWM`` read when each step's metrics row
appears (the training peak) and ``ru_maxrss`` at exit (the whole run, the final checkpoint
and HF export included). A watchdog kills the run if its RSS exceeds ``--kill-above-gib``
(default: the memory available at the start less 1 GiB, to spare other jobs on the host) or when
the host's available memory falls below 1 GiB, and says in which phase.

    python scripts/bench_memory.py load --model qwen3-1.7b [--quant int4] [--export]

``load`` writes the same checkpoint, then in a fresh process calls ``models.load_hf`` alone
(bf16; ``--quant``: the base quantised as it is read) and prints the process's peak RSS
(``VmHWM``) after it, its resident set and the bytes the parameters hold; ``--export`` then
writes them with ``models.save_hf`` and prints the peak after that too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30

# (hidden, intermediate, layers, heads, kv heads, tied) of the Qwen3 family (head dim 128)
SHAPES = {"qwen3-0.6b": (1024, 3072, 28, 16, 8, True), "qwen3-1.7b": (2048, 6144, 28, 16, 8, True),
          "qwen3-4b": (2560, 9728, 36, 32, 8, True), "qwen3-8b": (4096, 12288, 36, 32, 8, False)}
VOCAB = 151936
QUESTIONS = [("Tom has {a} apples and buys {b} more. How many apples?", "{a} + {b} = {c}\n#### {c}")]
RUN = ["train.steps=3", "train.batch_groups=2", "rollout.n=4", "rollout.max_new_tokens=32",
       "train.minibatches=1", "train.eval_every=0", "log.tensorboard=False"]


def write_config(path: str, name: str, shape: tuple | None = None, vocab: int = VOCAB) -> None:
  hidden, inter, layers, heads, kv, tied = shape or SHAPES[name]
  cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": vocab,
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


def write_weights(path: str, name: str, seed: int = 0, *, shard_bytes: int = 0,
                  shape: tuple | None = None, vocab: int = VOCAB) -> int:
  """Random bf16 weights under the HF names (0.02 normal; norms 1); returns the count.

  ``shard_bytes`` > 0: sharded files of about that many bytes plus
  ``model.safetensors.index.json`` (HF's layout), written as they fill, so the writer holds
  one shard at a time instead of the whole model."""
  import torch  # pylint: disable=import-outside-toplevel
  from safetensors.torch import save_file  # pylint: disable=import-outside-toplevel
  hidden, inter, layers, heads, kv, tied = shape or SHAPES[name]
  g = torch.Generator().manual_seed(seed)
  rand = lambda *shape: (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)
  ones = lambda n: torch.ones(n, dtype=torch.bfloat16)

  def tensors():
    yield "model.embed_tokens.weight", rand(vocab, hidden)
    yield "model.norm.weight", ones(hidden)
    if not tied:
      yield "lm_head.weight", rand(vocab, hidden)
    for i in range(layers):
      p = f"model.layers.{i}."
      yield from ((p + "self_attn.q_proj.weight", rand(heads * 128, hidden)),
                  (p + "self_attn.k_proj.weight", rand(kv * 128, hidden)),
                  (p + "self_attn.v_proj.weight", rand(kv * 128, hidden)),
                  (p + "self_attn.o_proj.weight", rand(hidden, heads * 128)),
                  (p + "self_attn.q_norm.weight", ones(128)),
                  (p + "self_attn.k_norm.weight", ones(128)),
                  (p + "mlp.gate_proj.weight", rand(inter, hidden)),
                  (p + "mlp.up_proj.weight", rand(inter, hidden)),
                  (p + "mlp.down_proj.weight", rand(hidden, inter)),
                  (p + "input_layernorm.weight", ones(hidden)),
                  (p + "post_attention_layernorm.weight", ones(hidden)))

  if not shard_bytes:
    t = dict(tensors())
    save_file(t, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return sum(x.numel() for x in t.values())
  weight_map, shard, size, count, total, files = {}, {}, 0, 0, 0, []

  def flush():
    fname = f"model-{len(files) + 1:05d}.safetensors"  # renamed "-of-N" below
    save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
    files.append((fname, list(shard)))

  for key, x in tensors():
    if shard and size + x.numel() * 2 > shard_bytes:
      flush()
      shard, size = {}, 0
    shard[key] = x
    size += x.numel() * 2
    count += x.numel()
    total += x.numel() * 2
  flush()
  for i, (fname, keys) in enumerate(files):
    final = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
    os.replace(os.path.join(path, fname), os.path.join(path, final))
    weight_map.update({k: final for k in keys})
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
  return count


def prepare(workdir: str, name: str, weights: bool, sharded: bool = False) -> tuple[str, str]:
  """The model directory and data file; ``sharded``: the weights written in ~1 GiB shards
  by a separate process (its peak stays out of this one and out of the measured run)."""
  model, data = os.path.join(workdir, name), os.path.join(workdir, "gsm8k.jsonl")
  os.makedirs(model, exist_ok=True)
  texts = write_data(data)
  write_config(model, name)
  write_tokenizer(model, texts)
  done = any(os.path.exists(os.path.join(model, f))
             for f in ("model.safetensors", "model.safetensors.index.json"))
  if weights and not done and sharded:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, os.path.abspath(__file__), "weights", "--model", name,
                    "--out", model], check=True)
    print(f"{name}: written in {time.perf_counter() - t0:.0f} s", flush=True)
  elif weights and not done:
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
  hardware = {hw: v for hw, v in hardware.items() if not args.devices or v[0] in args.devices}
  for name in args.models:
    model, data = prepare(args.workdir, name, weights=False)
    plans = {}
    for devices in sorted({d for d, _ in hardware.values()}):
      run = os.path.join(args.workdir, f"run-{name}-{devices}")
      env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
      out = subprocess.run(_cmd(model, data, run, ["train.dry_run=True"] + args.extra), cwd=ROOT,
                           env=env, capture_output=True, text=True)
      if out.returncode:
        sys.exit(out.stderr[-3000:])
      plans[devices] = json.load(open(os.path.join(run, "memory_plan.json")))
    for hw, (devices, capacity) in hardware.items():
      p = plans[devices]
      rl = p["state"]["rl"]
      steps = {k: v.get("extra", 0) for k, v in p["steps"].items()}
      label = " ".join([name] + [f"`{e}`" for e in args.extra])
      print(f"| {label} | {hw} | {_gib(rl['policy'])} | {_gib(rl['rl_optimizer'])} | "
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


# the LoRA / QLoRA runs (``lora``): the measured run's batch, KL on, no supervised stage
LORA_RUN = ["train.batch_groups=2", "rollout.n=4", "rollout.max_new_tokens=32",
            "train.minibatches=1", "train.eval_every=0", "log.tensorboard=False", "sft.steps=0",
            "loss.kl_beta=0.001"]


def lora_overrides(rank: int, quant: str = "", steps: int = 2) -> list[str]:
  """The LoRA run at the config's dtypes: rank-``rank`` adapters on every projection (float32,
  ``model.param_dtype``), the frozen base in the bf16 compute dtype (``model.lora.base_dtype``
  unset), ``quant`` ("" | "int8" | "int4") for QLoRA."""
  out = LORA_RUN + [f"train.steps={steps}", f"model.lora.rank={rank}"]
  return out + ([f"model.lora.quant={quant}"] if quant else [])


def full_overrides(steps: int = 2) -> list[str]:
  """Full fine-tuning of the same batch at the config's defaults (float32 master weights)."""
  return LORA_RUN + [f"train.steps={steps}"]


def plan_verdict(plan: dict) -> str:
  """One line: what a real run says before its first step (``memory.MemoryPlanError``, the
  state and the peak against the capacity) when the plan cannot fit, else that it fits."""
  from rl_jax.train import memory  # pylint: disable=import-outside-toplevel
  try:
    memory.check_state_fits(plan["state"], plan["capacity"], plan["capacity_source"])
    memory.check_plan_fits(plan)
  except memory.MemoryPlanError as e:
    return f"does not fit: {e}"
  return (f"fits: peak {_gib(max(plan['peak'].values()))} of {_gib(plan['capacity'])} "
          f"({plan['capacity_source']})")


def plan_summary(plan: dict) -> dict:
  rl = plan["state"]["rl"]
  steps = {k: v.get("extra", 0) for k, v in plan["steps"].items()}
  big = max(steps, key=steps.get)
  return {"state": sum(rl.values()), "parts": {k: v for k, v in rl.items() if v},
          "largest_step": big, "largest_step_extra": steps[big], "peak": plan["peak"]["rl"],
          "capacity": plan["capacity"], "dtypes": plan["dtypes"]}


def dry_run(model: str, data: str, run: str, overrides: list[str]) -> dict:
  """The plan of ``overrides`` (``train.dry_run``: no weight read, nothing run)."""
  subprocess.run(["rm", "-rf", run], check=True)
  out = subprocess.run(_cmd(model, data, run, overrides + ["train.dry_run=True"]), cwd=ROOT,
                       capture_output=True, text=True)
  if out.returncode:
    sys.exit(out.stderr[-3000:])
  return json.load(open(os.path.join(run, "memory_plan.json")))


def _proc_status(pid: int) -> dict[str, int]:
  """VmRSS, VmHWM, RssAnon, RssFile of ``pid`` in bytes ({} once it is gone)."""
  out = {}
  try:
    with open(f"/proc/{pid}/status") as f:
      for line in f:
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
          out[key] = int(rest.split()[0]) * 1024
  except OSError:
    return {}
  return out


def mem_available() -> int:
  with open("/proc/meminfo") as f:
    for line in f:
      if line.startswith("MemAvailable:"):
        return int(line.split()[1]) * 1024
  return 0


def run_watched(cmd: list[str], run: str, log_path: str, kill_above: int,
                poll_s: float = 0.05, min_free: int = GiB) -> dict:
  """Runs ``cmd`` (a training run writing ``run``); the kernel's peak RSS per phase: the
  high-water mark (VmHWM) when the state is loaded (``live_state`` in the plan) and when each
  step's metrics row appears, the sampled max of anonymous / file-backed RSS per phase, and
  ``ru_maxrss`` at exit. Kills the run when its RSS exceeds ``kill_above`` or the host's
  available memory falls below ``min_free`` (before the kernel's OOM killer picks a job)."""
  subprocess.run(["rm", "-rf", run], check=True)
  plan_path, metrics = os.path.join(run, "memory_plan.json"), os.path.join(run, "metrics.jsonl")
  t0 = time.perf_counter()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
  phase, marks, phases, killed, rows = "load", [], {}, None, 0
  while True:
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
    if pid:
      break
    st = _proc_status(proc.pid)
    if st:
      if phase == "load" and os.path.exists(plan_path):
        try:
          loaded = "live_state" in json.load(open(plan_path))
        except (ValueError, OSError):
          loaded = False
        if loaded:
          marks.append({"after": "load", "t": time.perf_counter() - t0, "hwm": st["VmHWM"]})
          phase = "step 1"
      if phase != "load" and os.path.exists(metrics):
        n = sum(1 for _ in open(metrics))
        if n > rows:
          rows = n
          marks.append({"after": f"step {n}", "t": time.perf_counter() - t0, "hwm": st["VmHWM"]})
          phase = f"step {n + 1}"
      p = phases.setdefault(phase, {"rss": 0, "anon": 0, "file": 0})
      p["rss"] = max(p["rss"], st.get("VmRSS", 0))
      p["anon"] = max(p["anon"], st.get("RssAnon", 0))
      p["file"] = max(p["file"], st.get("RssFile", 0))
      low = mem_available() < min_free  # other jobs share the host: never let it OOM
      if killed is None and (st.get("VmRSS", 0) > kill_above or low):
        killed = {"phase": phase, "rss": st["VmRSS"], "anon": st.get("RssAnon", 0),
                  "file": st.get("RssFile", 0), "t": time.perf_counter() - t0,
                  "why": "host memory low" if low else "rss limit"}
        proc.send_signal(signal.SIGKILL)
    time.sleep(poll_s)
  proc.returncode = os.waitstatus_to_exitcode(status)
  return {"returncode": proc.returncode, "wall_s": time.perf_counter() - t0,
          "peak_rss": usage.ru_maxrss * 1024, "marks": marks, "phases": phases,
          "killed": killed}


def lora(args) -> None:
  """The LoRA / QLoRA run of ``--model`` against its plan and ``--budget-gb``; with
  ``--full-plan`` the full fine-tuning dry run's verdict first."""
  name, budget = args.model, args.budget_gb * 1e9
  model, data = prepare(args.workdir, name, weights=not args.plan_only, sharded=True)
  label = f"lora r={args.lora_rank}" + (f" {args.lora_quant}" if args.lora_quant else "")
  result = {"model": name, "run": label, "budget_gb": args.budget_gb,
            "xla_flags": os.environ.get("XLA_FLAGS", "")}
  if args.full_plan:
    plan = dry_run(model, data, os.path.join(args.workdir, "plan-full"),
                   full_overrides(args.steps))
    result["full_plan"] = plan_summary(plan)
    result["full_verdict"] = plan_verdict(plan)
    print(f"{name} full fine-tuning (dry run): {result['full_verdict']}", flush=True)
  overrides = lora_overrides(args.lora_rank, args.lora_quant, args.steps) + list(args.extra)
  plan = dry_run(model, data, os.path.join(args.workdir, "plan-lora"), overrides)
  result["plan"] = plan_summary(plan)
  result["verdict"] = plan_verdict(plan)
  print(f"{name} {label} (dry run): {result['verdict']}", flush=True)
  if not args.plan_only:
    run = os.path.join(args.workdir, "run")
    kill_above = int(args.kill_above_gib * GiB) if args.kill_above_gib else (
        mem_available() - GiB)
    w = run_watched(_cmd(model, data, run, overrides), run,
                    os.path.join(args.workdir, "run.log"), kill_above)
    result["measured"] = w
    if os.path.exists(os.path.join(run, "metrics.jsonl")):
      rows = [json.loads(x) for x in open(os.path.join(run, "metrics.jsonl"))]
      result["step_time_s"] = [r.get("step_time_s") for r in rows]
      result["mismatch_max"] = max((r.get("mismatch_max", 0.0) for r in rows), default=None)
      result["kl"] = [r.get("kl") for r in rows]
    live = json.load(open(os.path.join(run, "memory_plan.json"))).get("live_state", {})
    result["live_state"] = sum(v for k, v in live.items() if k != "step")
    train_marks = [m for m in w["marks"] if m["after"].startswith("step")]
    result["train_peak"] = train_marks[-1]["hwm"] if train_marks else None
    result["export_peak"] = w["phases"].get(f"step {len(train_marks) + 1}", {}).get("rss")
    print(json.dumps(result, indent=1))
    if w["killed"]:
      k = w["killed"]
      print(f"killed by the watchdog ({k['why']}) in phase {k['phase']!r} at RSS "
            f"{_gib(k['rss'])} (anonymous {_gib(k['anon'])}, file-backed {_gib(k['file'])}; "
            f"limit {_gib(kill_above)}): peak over {k['rss'] / 1e9:.2f} GB; log: "
            f"{args.workdir}/run.log")
    elif w["returncode"]:
      why = ": SIGKILL, the OOM killer?" if w["returncode"] == -9 else ""
      print(f"run failed (rc {w['returncode']}{why}), peak RSS {_gib(w['peak_rss'])}; log: "
            f"{args.workdir}/run.log")
    for m in w["marks"]:
      print(f"  peak RSS through {m['after']}: {_gib(m['hwm'])} ({m['hwm'] / 1e9:.2f} GB), "
            f"t={m['t']:.0f} s")
    tp = result["train_peak"]
    if tp is not None:
      print(f"{name} {label}: training peak RSS {_gib(tp)} ({tp / 1e9:.2f} GB) "
            f"{'<=' if tp <= budget else '>'} {args.budget_gb:g} GB; whole run (checkpoint + HF "
            f"export included) {_gib(w['peak_rss'])} ({w['peak_rss'] / 1e9:.2f} GB); plan: "
            f"state {_gib(result['plan']['state'])} (live {_gib(result['live_state'])}), "
            f"device peak {_gib(result['plan']['peak'])}; step times {result['step_time_s']}")
  else:
    print(json.dumps(result, indent=1))
  if args.cleanup:
    subprocess.run(["rm", "-rf", model, os.path.join(args.workdir, "run")], check=True)


_LOAD_CHILD = r"""
import json, os, sys, time
import jax, jax.numpy as jnp
from rl_jax import models
def status():
  out = {}
  for line in open("/proc/self/status"):
    key, _, rest = line.partition(":")
    if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
      out[key] = int(rest.split()[0]) * 1024
  return out
model, quant, export = sys.argv[1], sys.argv[2], sys.argv[3]
res = {"start": status()}
t0 = time.perf_counter()
kw = dict(quant=quant) if quant else {}
cfg, params = models.load_hf(model, dtype=jnp.bfloat16, **kw)
jax.block_until_ready(params)
res["load_s"] = time.perf_counter() - t0
res["load"] = status()
res["param_bytes"] = sum(x.nbytes for x in jax.tree.leaves(params))
if export:
  t0 = time.perf_counter()
  models.save_hf(cfg, models.quant.dequantize_base(cfg, params), export)
  res["export_s"] = time.perf_counter() - t0
  res["export"] = status()
print("RESULT " + json.dumps(res), flush=True)
"""


def load(args) -> None:
  """Peak RSS of ``models.load_hf`` alone (and of ``save_hf`` after it), in a fresh process."""
  model, _ = prepare(args.workdir, args.model, weights=True, sharded=True)
  export = os.path.join(args.workdir, "export") if args.export else ""
  out = subprocess.run([sys.executable, "-c", _LOAD_CHILD, model, args.quant, export], cwd=ROOT,
                       capture_output=True, text=True, check=False)
  line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
  if out.returncode or not line:
    print(out.stdout[-2000:], out.stderr[-4000:])
    raise SystemExit(f"load failed (rc {out.returncode})")
  res = json.loads(line[0][len("RESULT "):])
  label = f"{args.model}" + (f" {args.quant}" if args.quant else " bf16")
  print(f"{label}: parameters {_gib(res['param_bytes'])}; load_hf peak RSS "
        f"{_gib(res['load']['VmHWM'])} ({res['load']['VmHWM'] / 1e9:.2f} GB; before it "
        f"{_gib(res['start']['VmRSS'])}), after it RSS {_gib(res['load']['VmRSS'])} (file-backed "
        f"{_gib(res['load']['RssFile'])}), {res['load_s']:.0f} s")
  if export:
    print(f"{label}: save_hf peak RSS {_gib(res['export']['VmHWM'])} "
          f"({res['export']['VmHWM'] / 1e9:.2f} GB), {res['export_s']:.0f} s")
    subprocess.run(["rm", "-rf", export], check=True)
  print(json.dumps(res))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = ap.add_subparsers(dest="mode", required=True)
  m = sub.add_parser("measure")
  m.add_argument("--workdir", default="/tmp/bench_memory")
  m.add_argument("--extra", nargs="*", default=[])
  p = sub.add_parser("predict")
  p.add_argument("--workdir", default="/tmp/bench_memory_predict")
  p.add_argument("--models", nargs="*", default=["qwen3-1.7b", "qwen3-4b", "qwen3-8b"])
  p.add_argument("--devices", nargs="*", type=int, default=[],
                 help="only the hardware rows with these device counts (1, 8)")
  p.add_argument("--extra", nargs="*", default=[], help="config overrides, e.g. a memory knob")
  k = sub.add_parser("knobs")
  k.add_argument("--workdir", default="/tmp/bench_memory_knobs")
  k.add_argument("--only", nargs="*", default=[], help="rows whose label contains one of these")
  lo = sub.add_parser("lora")
  lo.add_argument("--model", choices=["qwen3-1.7b", "qwen3-4b"], default="qwen3-1.7b")
  lo.add_argument("--lora-rank", type=int, default=16)
  lo.add_argument("--lora-quant", choices=["", "int8", "int4"], default="")
  lo.add_argument("--steps", type=int, default=2, help="GRPO steps")
  lo.add_argument("--budget-gb", type=float, default=12.0, help="peak RSS target (10^9 B)")
  lo.add_argument("--full-plan", action="store_true",
                  help="also the full fine-tuning dry run and its verdict")
  lo.add_argument("--plan-only", action="store_true", help="dry runs only (no weights)")
  lo.add_argument("--kill-above-gib", type=float, default=0.0,
                  help="kill the run above this RSS (0: available memory at start - 1 GiB)")
  lo.add_argument("--cleanup", action="store_true", help="delete the checkpoint afterwards")
  lo.add_argument("--extra", nargs="*", default=[])
  lo.add_argument("--workdir", default=None, help="default /tmp/bench_memory_<model>")
  ld = sub.add_parser("load")
  ld.add_argument("--model", choices=["qwen3-1.7b", "qwen3-4b"], default="qwen3-1.7b")
  ld.add_argument("--quant", choices=["", "int8", "int4"], default="")
  ld.add_argument("--export", action="store_true", help="then save_hf the loaded parameters")
  ld.add_argument("--workdir", default=None, help="default /tmp/bench_memory_<model>")
  w = sub.add_parser("weights")  # the checkpoint writer, run as its own process by prepare
  w.add_argument("--model", required=True)
  w.add_argument("--out", required=True)
  args = ap.parse_args()
  if args.mode in ("lora", "load") and args.workdir is None:
    args.workdir = f"/tmp/bench_memory_{args.model}"
  if args.mode == "weights":
    n = write_weights(args.out, args.model, shard_bytes=1 << 30)
    print(f"{args.model}: {n / 1e6:.0f}M parameters written", flush=True)
    return
  {"measure": measure, "predict": predict, "knobs": knobs, "lora": lora,
   "load": load}[args.mode](args)


if __name__ == "__main__":
  main()
