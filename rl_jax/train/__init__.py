"""The trainer: supervised warm start, then RL (GRPO family / PPO / off-policy corrections).

    python -m rl_jax.train --config=configs/quickstart.py --workdir=DIR [--config.x.y=v ...]

Split along the data flow of one step, each module depending only on those above it:

    streams      named random streams: every draw is a function of (seed, step, stream)
    group_size   adaptive group size: samples per prompt in fixed-shape chunks, per-prompt
                 advantages over ragged groups (data.group_size)
    selection_stage    which prompts are rolled out and which groups train (data.selector),
                 DAPO overlong shaping
    speculative_stage  SPEC-RL: earlier responses as drafts (rollout.speculative)
    context      config -> Setup (tokenizer, task, model config, mesh, objective, optimizers)
    on_policy    whether the update takes old_logp from its own policy pass
    startup      persistent compilation cache, compile-time clock, profiler trace of a step
    offload      train.offload: state parts in host memory (JAX memory kinds)
    state        TrainState; init_state and its abstract, sharded restore target (by step:
                 the supervised optimizer state only in the supervised stage, the reference
                 only in RL)
    resume       restore a step's checkpoint, older state layouts included
    layout       where the mesh meets the step: state and batch shardings, global batches
    steps        the jitted SFT step, RL update, log-prob / value / gradient-norm passes
    rollouts     prompts -> sampler or engine -> rewards -> objective inputs -> UpdateBatch
    evaluation   held-out greedy accuracy and pass@k
    memory       the memory plan: bytes per device of the state and of each compiled step
    loop         resume, step, evaluate, checkpoint, SIGTERM; ``train`` and ``main``

One RL step::

    prompts (seeded sampler) -> rollout.generate / RolloutEngine (M samples per prompt,
      behaviour log-probs) -> rewards (isolated verifiers) -> ObjectiveInputs (the fields the
      objective declares it needs) -> advantages -> ``train.minibatches`` optax updates
"""

from rl_jax.train.context import PROVIDED_INPUTS, Optimizers, Setup, build_setup
from rl_jax.train.evaluation import evaluate
from rl_jax.train.layout import Layout, jit_on_mesh, make_layout
from rl_jax.train.loop import main, make_trainer, rl_step, sft_batch, sft_step, train
from rl_jax.train.rollouts import Trainer, collect, objective_inputs
from rl_jax.train.state import (TrainState, abstract_state, begin_rl, init_state, make_engine)
from rl_jax.train.steps import (StepFns, UpdateBatch, make_grad_norm_fn, make_logprob_fn,
                                make_ref_logprob_fn, make_rl_update, make_sft_step,
                                make_step_fns, make_value_fn)
from rl_jax.train.streams import Stream, seed_for

__all__ = [
    "PROVIDED_INPUTS", "Optimizers", "Setup", "build_setup", "evaluate", "Layout",
    "jit_on_mesh", "make_layout", "main",
    "make_trainer", "rl_step", "sft_batch", "sft_step", "train", "Trainer", "collect",
    "objective_inputs", "TrainState", "abstract_state", "begin_rl", "init_state",
    "make_engine", "StepFns", "UpdateBatch", "make_grad_norm_fn", "make_logprob_fn",
    "make_ref_logprob_fn",
    "make_rl_update", "make_sft_step", "make_step_fns", "make_value_fn", "Stream", "seed_for",
]
