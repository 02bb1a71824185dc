"""Model x TPU topology sweeps of the topology dry run, as a table (docs/SCALING.md).

    python scripts/tpu_plan.py [--models qwen3-0.6b qwen3-1.7b qwen3-8b]
        [--topologies v5e:2x4 v5p:2x2x1 v6e:2x4] [--variants full lora]
        [--workdir /tmp/tpu_plan] [--prompt-words 200] [--extra KEY=V ...]

Needs libtpu (``pip install -e ".[tpu]"``); no TPU. For each model it writes a checkpoint
directory with only a ``config.json`` written by hand from the published shapes (``MODELS``;
Gemma-3-12B as the text-only ``gemma3_text`` config: the published checkpoint's config is the
multimodal ``gemma3`` one with a ``text_config``) and a stand-in tokenizer (word-level, a few
hundred words: the model's vocabulary, which sizes the embedding and the LM head, comes from
its config.json; the tokenizer only sets the prompts' length), and one synthetic GSM8K-format
file whose every question is ``--prompt-words`` words (prompt bucket P = 256 at the default
200 words with the config's template). Then, per model, topology and variant, in its own
process::

    python -m rl_jax.train --config=configs/gsm8k_hf.py --workdir=W/runs/<row> \\
        --config.model.hf_path=W/models/<model> --config.data.path=W/gsm8k_synthetic.jsonl \\
        --config.train.dry_run=True --config.dry_run.topology=<topology> [variant] [--extra]

``configs/gsm8k_hf.py`` at its defaults: 32 groups x 8 samples per step, 512 new tokens,
4 minibatches, bf16 compute with float32 master weights and Adam, full rematerialisation,
k3 KL (β = 0.001) against a bf16 reference copy; the mesh is FSDP over every chip.
Variants: ``full`` (that), ``lora`` (rank 16 on every projection, the frozen base in bf16,
the reference is the base), ``qlora`` (the same on an int4 base), ``int8_rollouts`` /
``fp8_rollouts`` (``full`` with the sampler decoding quantised projections). Each row is read
from the run's ``topology_plan.json``, or from its ``error:`` line when it does not fit; with
``--extra dry_run.max_batch=True`` also the largest ``train.batch_groups`` that fits
(``max_batch_groups``; one to four more compiles of each row's RL programs). Times and MFU
are XLA's estimates for the chip (``cost_analysis``), not measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 1 << 30

_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936,
              head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0,
              rms_norm_eps=1e-6, attention_bias=False, hidden_act="silu",
              torch_dtype="bfloat16", bos_token_id=151643, eos_token_id=151645)


def _qwen3(hidden, inter, layers, heads, kv, tied, **extra):
  return dict(_QWEN3, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
              num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=tied,
              **extra)


# config.json of each model, from the published checkpoints' shapes
MODELS = {
    "qwen3-0.6b": _qwen3(1024, 3072, 28, 16, 8, True),
    "qwen3-1.7b": _qwen3(2048, 6144, 28, 16, 8, True),
    "qwen3-8b": _qwen3(4096, 12288, 36, 32, 8, False),
    "qwen3-32b": _qwen3(5120, 25600, 64, 64, 8, False),
    "qwen3-30b-a3b": dict(_qwen3(2048, 6144, 48, 32, 4, False),
                          architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe",
                          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                          router_aux_loss_coef=0.001),
    "gemma3-12b": dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
                       vocab_size=262208, hidden_size=3840, intermediate_size=15360,
                       num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=256, query_pre_attn_scalar=256, sliding_window=1024,
                       sliding_window_pattern=6, rope_theta=1000000.0,
                       rope_local_base_freq=10000.0,
                       rope_scaling={"rope_type": "linear", "factor": 8.0},
                       max_position_embeddings=131072, rms_norm_eps=1e-6,
                       hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                       final_logit_softcapping=None, attn_logit_softcapping=None,
                       bos_token_id=2, eos_token_id=1, pad_token_id=0,
                       torch_dtype="bfloat16"),
}
# overrides per model family (MoE: train on the sampler's experts)
FAMILY = {"qwen3-30b-a3b": ["model.router_replay=True"]}
# with adapters, per model family (LoRA adapts a mixture-of-experts model's attention only)
ADAPTED = {"qwen3-30b-a3b": ["model.lora.targets=q,k,v,o"]}
VARIANTS = {
    "full": [],
    "lora": ["model.lora.rank=16", "model.lora.alpha=32.0", "model.param_dtype=bfloat16"],
    "qlora": ["model.lora.rank=16", "model.lora.alpha=32.0", "model.param_dtype=bfloat16",
              "model.lora.quant=int4", "model.lora.quant_block=128"],
    # the sampler decodes int8 / fp8 projections, the trainer keeps full
    "int8_rollouts": ["rollout.weight_dtype=int8"],
    "fp8_rollouts": ["rollout.weight_dtype=fp8"],
}
WORDS = [f"w{i}" for i in range(300)]


def write_model(path: str, name: str) -> None:
  """``config.json`` and a stand-in word-level tokenizer (eos ``</s>``, no bos)."""
  import tokenizers  # pylint: disable=import-outside-toplevel
  from tokenizers import models, pre_tokenizers  # pylint: disable=import-outside-toplevel
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(MODELS[name], f, indent=1)
  vocab = {w: i for i, w in enumerate(["<unk>", "</s>", "<pad>", *WORDS, "Question", "Answer",
                                       "end", "with", "number", "####", ":", "(", ")", "'",
                                       "<", ">", "."])}
  tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "</s>", "pad_token": "<pad>"}, f)


def write_data(path: str, words: int, rows: int = 64) -> None:
  """GSM8K-format rows whose questions are ``words`` words each."""
  with open(path, "w") as f:
    for i in range(rows):
      q = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words))
      f.write(json.dumps({"question": q, "answer": f"w1 w2\n#### {i}"}) + "\n")


def run_one(workdir: str, model: str, topology: str, variant: str, extra: list[str],
            timeout: float) -> dict:
  """One dry run in its own process: the plan's row, or the error line."""
  label = f"{model}_{topology.replace(':', '-')}_{variant}"
  run_dir = os.path.join(workdir, "runs", label)
  os.makedirs(run_dir, exist_ok=True)
  cmd = [sys.executable, "-m", "rl_jax.train", "--config=configs/gsm8k_hf.py",
         f"--workdir={run_dir}", f"--config.model.hf_path={os.path.join(workdir, 'models', model)}",
         f"--config.data.path={os.path.join(workdir, 'gsm8k_synthetic.jsonl')}",
         "--config.train.dry_run=True", f"--config.dry_run.topology={topology}"]
  adapted = ADAPTED.get(model, []) if variant in ("lora", "qlora") else []
  cmd += [f"--config.{o}"
          for o in FAMILY.get(model, []) + VARIANTS[variant] + adapted + list(extra)]
  plan_file = os.path.join(run_dir, "topology_plan.json")
  if os.path.exists(plan_file):  # an earlier sweep's
    os.remove(plan_file)
  t0 = time.perf_counter()
  try:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, PYTHONPATH=ROOT))
  except subprocess.TimeoutExpired:
    return dict(model=model, topology=topology, variant=variant, error=f"timed out after "
                f"{timeout:.0f} s", wall_s=time.perf_counter() - t0)
  row = dict(model=model, topology=topology, variant=variant, wall_s=time.perf_counter() - t0,
             command=" ".join(cmd[1:]))
  errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
  if os.path.exists(plan_file) and out.returncode in (0, 2):
    with open(plan_file) as f:
      plan = json.load(f)
    est = plan["estimate"]
    rl = est.get("rl_step", {})
    row.update(mesh=plan["mesh"], peak=est["peak"], capacity=plan["capacity"],
               peak_program=est["peak_program"], fits=est["fits"],
               state=sum(plan["state"]["rl"].values()), step_s=rl.get("seconds"),
               rollout_s=rl.get("rollout_s"), learner_s=rl.get("learner_s"),
               mfu=rl.get("mfu"), model_mfu=rl.get("model_mfu"),
               kernels=sorted({k for p in plan["programs"].values() for k in p["kernels"]}),
               grown_peak=plan.get("kv_pool_plan", {}).get("grown_peak"),
               max_batch_groups=plan.get("max_batch_groups"),
               max_batch_verified=plan.get("max_batch", {}).get("verified"))
  if out.returncode != 0:
    row["error"] = errors[-1] if errors else (out.stderr.strip().splitlines() or ["?"])[-1]
  return row


def _gib(n) -> str:
  return "" if n is None else f"{n / GiB:.2f}"


def table(rows: list[dict]) -> str:
  """Markdown rows of the sweep."""
  out = ["| model | topology | variant | fits | peak GiB/chip (program) | state GiB/chip | "
         "est. RL step s (rollout + learner) | est. MFU | largest batch_groups |",
         "|---|---|---|---|---|---|---|---|---|"]
  for r in rows:
    if "peak" not in r:
      out.append(f"| {r['model']} | {r['topology']} | {r['variant']} | no | "
                 f"{r.get('error', '')} | | | | |")
      continue
    largest = r.get("max_batch_groups")
    verified = r.get("max_batch_verified")  # None: not searched
    largest = ("" if verified is None else "none" if largest is None else
               f"{largest}" if verified else f">= {largest}")
    step = ("" if r["step_s"] is None else
            f"{r['step_s']:.1f} ({r['rollout_s']:.1f} + {r['learner_s']:.1f})")
    mfu = "" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
    model = "" if r.get("model_mfu") is None else f"{100 * r['model_mfu']:.1f}%"
    mfu = mfu if model in ("", mfu) else f"{mfu} (model FLOPs: {model})"
    out.append(f"| {r['model']} | {r['topology']} | {r['variant']} | "
               f"{'yes' if r['fits'] else 'no'} | {_gib(r['peak'])} of {_gib(r['capacity'])} "
               f"({r['peak_program']}) | {_gib(r['state'])} | {step} | {mfu} | {largest} |")
  return "\n".join(out)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--models", nargs="*", default=["qwen3-0.6b", "qwen3-1.7b", "qwen3-8b"],
                 choices=sorted(MODELS))
  p.add_argument("--topologies", nargs="*", default=["v5e:2x4", "v5p:2x2x1", "v6e:2x4"])
  p.add_argument("--variants", nargs="*", default=["full"], choices=sorted(VARIANTS))
  p.add_argument("--workdir", default="/tmp/tpu_plan")
  p.add_argument("--prompt-words", type=int, default=200)
  p.add_argument("--timeout", type=float, default=1800.0, help="seconds per dry run")
  p.add_argument("--extra", nargs="*", default=[], help="config overrides KEY=VALUE")
  args = p.parse_args(argv)
  os.makedirs(args.workdir, exist_ok=True)
  write_data(os.path.join(args.workdir, "gsm8k_synthetic.jsonl"), args.prompt_words)
  rows = []
  for model in args.models:
    write_model(os.path.join(args.workdir, "models", model), model)
    for topo in args.topologies:
      for variant in args.variants:
        row = run_one(args.workdir, model, topo, variant, args.extra, args.timeout)
        print(json.dumps(row, default=str), flush=True)
        rows.append(row)
  with open(os.path.join(args.workdir, "rows.json"), "w") as f:
    json.dump(rows, f, indent=1, default=str)
  print(table(rows))


if __name__ == "__main__":
  main()
