"""packscore's service: the HTTP server and the offline scorer around a ``ScoringBackend``.

- ``cli``: ``packscore serve`` / ``packscore score`` (``entrypoint``: the console script, which
  exits 0 on a SIGTERM that comes before the server runs, 143 with a line before ``score`` scores);
  ``settings``: the one typed config; ``hub``: a Hugging Face hub id ``--model`` resolved to a local snapshot directory.
- ``backends``: ``load_backend(settings)``, the worker pool or the scorer in this process.
- ``http/``: the FastAPI app, schemas, encodings, errors, metrics, validation, the server.
- ``scheduling/``: dynamic batching of requests into packed forwards.
- ``runtime``: ``Service``, one running service: loading, readiness, draining; its parts ``readiness`` (what
  /readyz answers) and ``draining`` (a drain, a stop); ``load_thread``: the thread a load or an update runs in.
- ``offline``: scoring a JSONL file, resumable.
- ``client/``: the Python client, its own distribution (``packscore_client``; ``service.client`` is an alias).
- ``local_server``, ``testing``: a local server process, fakes for tests.
"""
