"""The RL loop over the rollout harness: play a step's groups, learn from exactly their tokens, push the weights,
checkpoint (train.py), what a resume may go on from (train_resume.py), a step's rows and metrics (train_step.py),
the re-rendered-context ablations (rerendered.py) and the weights of a run's version (run_weights.py)."""
