"""Agentic quickstart: a tiny character-level policy learns to use a calculator tool.

    python -m rl_jax.train --config=configs/agent_quickstart.py --workdir=/tmp/aq
    python -m rl_jax.train --config=configs/agent_quickstart.py:guess --workdir=/tmp/aq_guess

Task (``env.name="calculator"``): multiply two numbers of 2-3 digits; the product is too hard
for the model in its head, easy with the ``calc`` tool in the compact call format::

    U:123*45
    A:<c>123*45</c><eos>T:5535
    A:5535<eos>

reward 1 for the exact product (the final answer is the turn without a call), at most 3 turns.
Held-out success = greedy episodes on 128 products never seen in training.
Stage 1 (``sft``): a short supervised warm start on the task expert's trajectories (loss on the
assistant's tokens only, the tool's answers masked). Stage 2 (``train``): GRPO on whole
trajectories (trajectory-level group-normalised advantages, PPO clip, no KL), M = 8 episodes
per prompt; the trained tokens are the sampled ids and the appended observation ids, exactly.
``:guess`` plays the number-guessing game instead (binary search in [1, 20] from
"higher"/"lower" feedback, at most 5 guesses).

Stage sizes: 62 supervised steps (batch 64, η = 2e-3), then 100 GRPO steps of 16 prompts,
temperature 0.7, η = 3e-4, β = 0 (no KL).

Expected result (2-core AMD EPYC CPU with AVX-512, JAX 0.10.2, measured): held-out greedy
success 0.352 after the warm start (step 62) -> 0.664 after 38 GRPO steps (step 100) -> 0.695
at the end (step 162), +34 points (0.703 at step 150; 0.672 before the CPU default
``model.fused_mlp=auto``, 0.711 before ``model.prefix_attention=auto``); training reward 0.03
(first 5 RL steps) -> 0.38 (last 5) at temperature 0.7; every episode takes 2 turns (tool
call, answer); 16% of tool calls are malformed in the first 20 RL steps, 5% in the last 20 (``tool_errors_bad_call`` /
``tool_errors_bad_arguments``). The whole command takes
46 s from a cold compilation cache on a quiet host. The success rate
plateaus near 0.70 (the tiny model's copying of digits): more GRPO steps do not raise it.
``:guess`` (same stages, measured): 0.50 -> 0.55 success on the 20 targets, 3.1 turns per
episode, 2 min 18 s; the 30-point target is met by the calculator task only.
"""

from rl_jax import config as base


def get_config(arg=None):
  config = base.base_config()
  config.model.update(architecture="qwen3", hidden_size=64, intermediate_size=192,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                      max_position_embeddings=64)
  config.mesh.shape = dict(data=1, fsdp=-1, sequence=1, tensor=1)
  config.env.update(name="calculator", max_turns=3, max_total_tokens=40, max_turn_tokens=16,
                    max_obs_tokens=12, workers=4, digits_min=2, digits_max=3)
  config.data.update(eval_size=128, max_prompt_len=24)
  config.rollout.update(n=8, temperature=0.7)
  config.loss.update(preset="grpo", kl_beta=0.0)
  config.optim.update(lr=3e-4, grad_clip=1.0)
  config.sft.update(steps=62, lr=2e-3, batch_size=64)
  config.train.update(steps=100, batch_groups=16, minibatches=1, seed=0, eval_every=25,
                      checkpoint_every=10, keep=2)
  config.train.old_logp_pass = "separate"
  if arg == "guess":
    config.env.update(name="guess", max_turns=5, max_total_tokens=40, max_turn_tokens=4,
                      max_obs_tokens=12, guess_n=20)
  elif arg:
    raise ValueError(f"agent_quickstart: unknown argument {arg!r} (use ':guess' or nothing)")
  return config
