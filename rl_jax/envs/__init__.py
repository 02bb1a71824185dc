"""Environments, tools and chat formats for multi-turn (agentic) rollouts.

Modules: ``base`` (interfaces), ``chat`` (templates, append-only tokenization),
``tool_calls`` (parsers), ``tools`` (calculator, Python sandbox), ``tool_env``
(``ToolEnvironment``), ``spec`` (``EnvSpec``, ``run_episode``), ``tasks`` (built-in tasks),
``adapters`` (gymnasium, verifiers).
"""

from rl_jax.envs.base import Environment, Message, StepResult, Tool
from rl_jax.envs.spec import EnvSpec, run_episode

__all__ = ["EnvSpec", "Environment", "Message", "StepResult", "Tool", "run_episode"]
