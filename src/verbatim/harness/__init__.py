"""The rollout loop, runs (groups, resume, graceful stop), the append-only ledger and trace storage."""
