"""Quickstart: a tiny character-level policy learns to sort digits on a laptop CPU.

    python -m rl_jax.train --config=configs/quickstart.py --workdir=/tmp/rl_jax_quickstart

Task: ``"sort 302:"`` -> ``"023"`` (three digits; 793 train prompts, 207 held-out prompts
that never appear in training), reward 1 for the exact answer.
Stage 1 (``sft``, 25 steps): a short supervised warm start on train prompt/answer pairs.
Stage 2 (``train``, 250 steps): GRPO — group-normalised advantages, PPO clip ε = 0.2,
N = 8 samples per prompt (rollout.n) at temperature 0.5, 32 prompts per step, β = 0 (no KL),
η = 2e-4 — lifts held-out greedy accuracy.

Expected result (2-core CPU, JAX 0.10.2, measured): the whole command takes under half a
minute; held-out greedy accuracy 0.454 after the supervised stage (step 25) -> 0.937 at the
end (step 275; 0.942 at step 225), pass@4 0.068 -> 0.981; training reward 0.02 -> 0.87
(0.957 before the CPU default ``model.fused_mlp=auto``, 0.971 before
``model.prefix_attention=auto``; docs/BENCHMARKS.md, "The defaults of 2026-11-28").
Curves: DIR/curves.png.
These digits are from an AVX-512 CPU: XLA's CPU kernels round by instruction set, so a run
is bit-exact on one machine but not across machines (docs/BENCHMARKS.md lists the spread).
With XLA's CPU defaults (``--config.train.cpu_fast_compile=False
--config.train.cpu_xla_reductions=False``) the same machine ends at 0.932.

LoRA (``:lora``; rank-8 adapters, frozen base, adapter-only optimizer state)::

    python -m rl_jax.train --config=configs/quickstart.py:lora --workdir=/tmp/rl_jax_lora

Expected result (2-core AMD EPYC CPU with AVX-512, measured): held-out greedy accuracy 0.082
after the 10-step LoRA warm start -> 0.773 at the end (step 260; 0.749 at step 250),
pass@4 0.116 -> 0.797 (0.729 before ``model.fused_mlp=auto``).
Writes DIR/hf
(merged), DIR/hf_adapter (PEFT) and DIR/hf_base.

QLoRA (``:qlora``; the same adapters on a frozen base stored int4, a float32 scale per 16
entries; ``--config.model.lora.quant=int8`` for int8)::

    python -m rl_jax.train --config=configs/quickstart.py:qlora --workdir=/tmp/rl_jax_qlora

Expected result (2-core AMD EPYC CPU with AVX-512, measured): held-out greedy accuracy 0.087
after the warm start -> 0.720 at the end (step 260), pass@4 0.111 -> 0.773 (int8, measured
before ``prefix_attention=auto``: 0.072 -> 0.700). The base's
projections take 72 KiB (int4) / 120 KiB (int8) instead of 384 KiB (float32). DIR/hf holds
the dequantised base with the adapters merged.
"""

from rl_jax import config as base


def get_config(arg=None):
  config = base.base_config()
  config.model.update(architecture="qwen3", hidden_size=64, intermediate_size=192,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64)
  config.mesh.shape = dict(data=1, fsdp=-1, sequence=1, tensor=1)
  config.data.update(task="sorting", difficulty=0, eval_size=256, max_prompt_len=24)
  config.rollout.update(n=8, max_new_tokens=5, temperature=0.5)
  config.loss.update(preset="grpo", kl_beta=0.0)
  config.optim.update(lr=2e-4, grad_clip=1.0)
  config.sft.update(steps=25, lr=1e-3, batch_size=128)
  config.train.update(steps=250, batch_groups=32, minibatches=1, seed=0, eval_every=25,
                      checkpoint_every=20, keep=2)
  # The separate old-log-prob pass keeps the documented numbers bit-reproducible; "auto" (the
  # base default) takes them from the update's own pass: the same update to float rounding,
  # one forward pass less per step, a different (equally valid) rounding trajectory.
  config.train.old_logp_pass = "separate"
  config.eval.pass_k = 4  # pass@4 at the rollout temperature on the held-out split
  if arg == "lora":  # rank-8 adapters on every projection; the base stays frozen
    config.model.lora.update(rank=8, alpha=16.0)
    # a frozen random lm_head of std 0.02 caps the logits the adapters can reach near 1.3
    # nats (the supervised stage then stalls at a loss of ~3.8); std 0.1 leaves room
    config.model.init_std = 0.1
    config.sft.update(steps=10, lr=1e-2)
    config.optim.lr = 5e-4
  elif arg == "qlora":  # the same adapters on a 4-bit base (int4, a scale per 16 entries)
    config = get_config("lora")
    config.model.lora.update(quant="int4", quant_block=16)  # 16 divides head_dim=16
  elif arg:
    raise ValueError(f"configs/quickstart.py takes no argument, 'lora' or 'qlora', got {arg!r}")
  return config
