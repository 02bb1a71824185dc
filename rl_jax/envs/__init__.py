"""Environments, tools and chat formats for multi-turn (agentic) rollouts."""

from rl_jax.envs.base import Environment, Message, StepResult, Tool

__all__ = ["Environment", "Message", "StepResult", "Tool"]
