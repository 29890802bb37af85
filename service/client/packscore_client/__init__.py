"""Python client of the packscore HTTP API (docs/api.md). Needs numpy, httpx and msgpack only: no torch,
no transformers, none of the server's packages (``pip install ./service/client``).

    >>> client = ScoreClient("http://127.0.0.1:8000", api_key=None)
    >>> out = client.score([{"input_ids": [1, 2, 3, 4], "score_from": 2}], top_k=5)
    >>> out[0].logprobs.shape, out[0].top_k_ids.shape
    ((2,), (2, 5))
    >>> padded = client.score_padded(input_ids, attention_mask, response_mask)  # a trainer's [B, T] batch
    >>> padded.logprobs.shape == response_mask.shape
    True

- msgpack by default (raw int32 ids out, raw float32 arrays back), JSON with ``encoding="json"``.
- 429 and 503 are retried after their ``Retry-After`` until ``retry_timeout_s`` has passed since the
  call started (an INFO line each); an unreachable server is retried for ``connect_retry_s`` (a log line each), within
  that ``retry_timeout_s``, then ``ScoreError(0, "connection_error", ...)``.
- A batch larger than the server accepts in one request is split under its limits (read from the
  ``X-Packscore-Max-*`` headers of every answer, from /readyz before the first call, or given as
  knobs); the parts are sent concurrently and the results come back in input order. A body the
  server's read timeout cut off (408, a slow link) is sent again in halves; one a proxy's own 413
  page refused, in parts under its size, as are later calls' bodies.
- Every result names the weights version that scored it (parts of a split batch may differ unless
  ``weights_version=`` pins one); a sequence sent with ``rollout_logprobs`` gets ``mismatch``.
  ``update_weights(model, path)`` asks the server to serve a new checkpoint (docs/weights.md);
  ``update_weights_everywhere(model, path)`` asks every address the URL's host resolves to (each pod
  behind a headless Service), all under one ``X-Request-Id``, and returns ``{address: WeightsUpdate}``.
- ``score_padded`` takes padded batches as verl and OpenRLHF hold them and never sends a pad; the
  plain ``score`` refuses a 2-D array rather than score its pad tokens.
"""

from packscore_client.clients import AsyncScoreClient, ScoreClient
from packscore_client.padded import PaddedScores
from packscore_client.errors import ScoreError, UpdateEverywhereError
from packscore_client.protocol import Limits, ScoredSequence, WeightsUpdate

__all__ = ["AsyncScoreClient", "Limits", "PaddedScores", "ScoreClient", "ScoreError", "ScoredSequence",
           "UpdateEverywhereError", "WeightsUpdate"]
