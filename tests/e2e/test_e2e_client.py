"""The bundled client against a real server process, where a trainer meets it: keys as they are read
from files, a failed call's leftovers, dict keys the contract does not name."""

from __future__ import annotations

import pytest

from packscore_client import ScoreClient
from tests.e2e.helpers import API_KEY


def test_a_key_read_from_a_file_with_its_newline_scores_and_a_bad_key_is_never_quoted(tiny_server):
    # open(path).read() keeps the newline; the server strips its own key file the same way
    with ScoreClient(tiny_server.url, API_KEY + "\n", admin_key=" admin\n") as client:
        (result,) = client.score([[1, 2, 3]])
        assert result.logprobs.shape == (2,)
        assert client.models()[0]["id"] == "tiny"
    for where in ("api_key", "admin_key"):
        with pytest.raises(ValueError, match=where) as refused:
            ScoreClient(tiny_server.url, **{where: "sec\nret"})
        assert "sec" not in str(refused.value)


def test_a_sequence_key_the_contract_does_not_name_is_refused_not_dropped(tiny_server):
    with ScoreClient(tiny_server.url, API_KEY) as client:
        with pytest.raises(ValueError, match=r"sequences\[1\]: 'scorefrom' is not a field"):
            client.score([[1, 2, 3], {"input_ids": [1, 2, 3, 4], "scorefrom": 3}])
        # the four it takes, all at once
        (result,) = client.score([{"id": "a", "input_ids": [1, 2, 3, 4], "score_from": 3, "rollout_logprobs": [-1.0]}])
        assert (result.id, result.logprobs.shape, sorted(result.mismatch)) == ("a", (1,), ["k3_kl", "max_abs_diff",
                                                                                    "mean_abs_diff"])
