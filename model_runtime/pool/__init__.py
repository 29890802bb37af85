"""The worker pool: one process per rank, reached over pipes carrying msgpack frames.

- ``pool``: ``WorkerPool`` / ``start_pool``, the ``ScoringBackend`` the service talks to.
- ``procs``: launching and stopping the rank processes.
- ``worker``: one rank's process (``python -m model_runtime.pool.worker``).
- ``messages``: the messages that cross the process boundary.
- ``ports``: a free TCP port for the process group.
"""
