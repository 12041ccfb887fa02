"""What a command runs, as one config and one function.

``verbatim train`` maps its flags onto :class:`~verbatim.jobs.train.TrainConfig` and calls
:func:`~verbatim.jobs.train.run_training`; a torchrun worker or a user's own script builds the same
config and calls the same function, so every training run is composed in one place. This room sits
above ``agents`` (a run may play an agent through the endpoint), which the harness may not import.
"""
