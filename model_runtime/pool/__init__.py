"""The worker pool: one process per rank, reached over pipes carrying msgpack frames.

- ``pool``: ``WorkerPool`` / ``start_pool``, the ``ScoringBackend`` the service talks to.
- ``supervisor``: starting a world of workers, watching its replies, restarting it after a failure.
- ``updates``: weight updates (load beside the served weights on every rank, then swap).
- ``lockstep``: FSDP's stepper, every group's row (or an idle step) sent at once.
- ``procs``: launching and stopping the rank processes.
- ``replies``: what the pool awaits from its workers, and their replies turned into results or errors.
- ``loaded_files``: the checkpoint directory as the workers loaded it, checked before a restart.
- ``worker_main``: a rank's process (``python -m model_runtime.pool.worker_main``), watching the pool's before it imports torch.
- ``worker``: what that process runs: one rank.
- ``messages``: the messages that cross the process boundary.
- ``ports``: a free TCP port for the process group.
"""
