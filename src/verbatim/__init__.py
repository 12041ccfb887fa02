"""verbatim: token-exact multi-turn rollouts for RL on LLM agents."""

__version__ = "0.1.0"
