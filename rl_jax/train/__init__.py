"""The trainer: supervised warm start, then RL (GRPO family / PPO / off-policy corrections).

    python -m rl_jax.train --config=configs/quickstart.py --workdir=DIR [--config.x.y=v ...]

One RL step is a producer and a learner joined by a runner (docs/ARCHITECTURE.md has the
diagram and what each module receives and hands on)::

    producer   ProducerState, weights -> prompt source -> rollout -> scoring -> Scored
    learner    Scored, TrainState -> objective inputs -> advantages -> optimizer updates
    runner     lag 0 (the synchronous trainer), lag k, or free-running

Modules by layer: ``rl_jax/train/layers.py`` (``LAYERS``: each layer's modules, what they
receive and hand on; the import rules ``tests/test_structure.py`` enforces).

Shapes: the package legend (``rl_jax/__init__.py``).
"""

from rl_jax.train.context import Optimizers, Setup, build_setup
from rl_jax.train.inputs import PROVIDED_INPUTS
from rl_jax.train.evaluation import evaluate
from rl_jax.train.layout import Layout, jit_on_mesh, make_layout
from rl_jax.train.loop import main, make_trainer, rl_step, sft_batch, sft_step, train
from rl_jax.train.learner import objective_inputs
from rl_jax.train.records import ProducerState, Scored
from rl_jax.train.rollouts import TrainParts
from rl_jax.train.runner import FixedLag, FreeRunning, collect, make_runner
from rl_jax.train.state import (TrainState, abstract_state, begin_rl, init_state, make_engine)
from rl_jax.train.steps import (StepFns, UpdateBatch, make_advantage_fn, make_grad_norm_fn,
                                make_logprob_fn, make_ref_logprob_fn, make_rl_update,
                                make_sft_step, make_step_fns, make_value_fn, rl_apply,
                                rl_grads)
from rl_jax.train.streams import Stream, seed_for

__all__ = [
    "PROVIDED_INPUTS", "Optimizers", "Setup", "build_setup", "evaluate", "Layout",
    "jit_on_mesh", "make_layout", "main",
    "make_trainer", "rl_step", "sft_batch", "sft_step", "train", "TrainParts",
    "objective_inputs", "ProducerState", "Scored", "FixedLag", "FreeRunning", "collect",
    "make_runner",
    "TrainState", "abstract_state", "begin_rl", "init_state",
    "make_engine", "StepFns", "UpdateBatch", "make_advantage_fn", "make_grad_norm_fn",
    "make_logprob_fn",
    "make_ref_logprob_fn",
    "make_rl_update", "make_sft_step", "make_step_fns", "make_value_fn", "rl_apply", "rl_grads",
    "Stream", "seed_for",
]
