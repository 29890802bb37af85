"""``service.client``: the name the client had inside the server's package, kept as an alias of
``packscore_client`` (service/client/packscore_client, its own distribution: ``pip install ./service/client``)."""

from packscore_client import AsyncScoreClient, Limits, PaddedScores, ScoreClient, ScoredSequence, ScoreError, WeightsUpdate

__all__ = ["AsyncScoreClient", "Limits", "PaddedScores", "ScoreClient", "ScoreError", "ScoredSequence", "WeightsUpdate"]
