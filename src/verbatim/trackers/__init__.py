"""Experiment trackers: a run's metrics, config and sampled rollouts, sent where its researcher watches runs.

``verbatim train --log wandb|tensorboard|mlflow|trackio`` (repeatable; ``run`` too) opens one
:class:`~verbatim.trackers.fanout.Trackers` per run. Each step it logs the step's ``metrics.jsonl`` record
(nested values as ``name/key``; numbers only), and a small table of the step's sampled rollouts (the
conversation as text, reward, status, turns, token counts); at the start the run's config. Each tracker
writes through its library's own API, imported only when asked for (an optional extra:
``pip install 'verbatim-rl[wandb]'``), and works offline: W&B's ``WANDB_MODE=offline`` run folder under the
run directory, TensorBoard event files in ``RUN_DIR/tensorboard``, an MLflow store (``MLFLOW_TRACKING_URI``,
else a local one in ``RUN_DIR/mlruns``), trackio's local database (``TRACKIO_DIR``).

``metrics.jsonl`` stays the record: a tracker that fails during a run is dropped with one warning line and the
run goes on.
"""
