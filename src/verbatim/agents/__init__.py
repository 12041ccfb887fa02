"""Bring your own agent: a token-exact OpenAI-compatible endpoint per rollout (docs/environments.md)."""
