"""Following the trainer with a real server: a policy and a reference served together, the policy's
weights swapped under continuous load (API.md "POST /v1/weights", "Several models in one deployment").

Every answer is compared with an in-process scorer of the version it names.
"""

import threading
import time

import httpx
import msgpack
import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from model_runtime.types import SequenceInput
from service.client import ScoreClient, ScoreError
from tests.checkpoints import build_hf_model, rewrite_checkpoint, save_checkpoint
from tests.e2e.helpers import (API_KEY, AUTH, TOL, ServerProcess, assert_matches, decode, long_forward_body, post,
                               post_in_background, queued_sequences, random_sequences, served_versions)


ADMIN_KEY = "e2e-admin"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
VOCAB = 512  # tests/checkpoints.py's vocabulary


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    """A server with a policy (under the weights root) and a reference; checkpoints and their scorers."""
    from model_runtime.scoring.loading import load_model
    from model_runtime.scoring.scorer import Scorer

    tmp = tmp_path_factory.mktemp("weights")
    root = tmp / "root"
    policy0 = save_checkpoint("qwen3_5", root / "step-0", seed=0)
    policy1 = save_checkpoint("qwen3_5", root / "step-1", seed=1)
    reference = save_checkpoint("qwen3_5", tmp / "reference", seed=2)
    broken = save_checkpoint("qwen3_5", root / "broken", seed=3)
    tensors = load_file(broken / "model.safetensors")
    dropped = sorted(tensors)[-1]
    del tensors[dropped]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    # a norm stored twice (Hugging Face's loader would take one copy) and a weight stored as integers: refused
    norm = "model.layers.0.input_layernorm.weight"
    rewrite_checkpoint(policy1, root / "doubled", lambda t: {**t, norm.removeprefix("model."): t[norm] + 1})
    rewrite_checkpoint(policy1, root / "integer", lambda t: {**t, norm: (t[norm] * 100).int()})
    # same architecture, other shapes (a wider MLP): refused as incompatible, not as incomplete
    build_hf_model("qwen3_5", seed=4, text={"intermediate_size": 96}).save_pretrained(root / "wider")
    (tmp / "outside").mkdir()
    (root / "escape").symlink_to(tmp / "outside", target_is_directory=True)

    server = ServerProcess(tmp, "--model", f"policy={policy0}", "--model", f"ref={reference}", "--weights-root", str(root),
                           "--admin-key", ADMIN_KEY, "--max-batch-tokens", "256", "--max-wait-ms", "2")
    try:
        server.wait_ready(timeout=240)
        scorers = {name: Scorer(load_model(str(path)), max_batch_tokens=4096)
                   for name, path in (("step-0", policy0), ("step-1", policy1), ("ref", reference))}
        yield {"server": server, "scorers": scorers, "dropped": dropped}
    finally:
        assert server.stop() == 0, server.log()


def test_a_policy_swapped_under_load_beside_its_reference(deployment):
    server, scorers = deployment["server"], deployment["scorers"]
    url = server.url
    first = served_versions(url)["policy"]
    ref_version = served_versions(url)["ref"]
    version_scorer = {first: scorers["step-0"], "step-1": scorers["step-1"]}

    # Two served: a request must name its model.
    omitted = post(url, {"sequences": [{"input_ids": [1, 2, 3]}]})
    assert omitted.status_code == 422 and omitted.json()["error"]["type"] == "model_required", omitted.text

    answers: list[tuple[str, list[dict], httpx.Response, bool]] = []  # model, sent, answer, sent after the update
    updated, stop = threading.Event(), threading.Event()

    def load(i: int) -> None:
        rng = np.random.default_rng(1000 + i)
        model = "ref" if i == 2 else "policy"
        while not stop.is_set():
            seqs = random_sequences(rng, int(rng.integers(1, 4)), VOCAB, lengths=(2, 40))
            after = updated.is_set()
            answer = post(url, {"model": model, "sequences": seqs}, encoding="msgpack" if i % 2 else "json")
            answers.append((model, seqs, answer, after))

    def wait_for(condition, what: str) -> None:
        deadline = time.monotonic() + 300
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.05)

    threads = [threading.Thread(target=load, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: sum(a[0] == "policy" for a in answers) >= 2, "answers before the update")
        update = httpx.post(url + "/v1/weights", json={"model": "policy", "path": "step-1", "version": "step-1"},
                            headers=ADMIN, timeout=300)
        updated.set()
        wait_for(lambda: sum(a[0] == "policy" and a[3] for a in answers) >= 2 and any(a[0] == "ref" and a[3] for a in answers),
                 "answers after the update")
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert update.status_code == 200, update.text
    body = update.json()
    assert (body["model"], body["weights_version"], body["previous_version"]) == ("policy", "step-1", first)
    print(f"[weights e2e] update of the tiny policy: load {body['load_s']:.3f}s, swap {body['swap_ms']:.2f}ms; "
          f"{len(answers)} answers under load")

    seen = {"policy": set(), "ref": set()}
    for model, seqs, response, after in answers:
        assert response.status_code == 200, response.text
        got = response.json() if response.headers["content-type"] == "application/json" else msgpack.unpackb(response.content)
        version = got["weights_version"]
        seen[model].add(version)
        if model == "ref":
            assert version == ref_version
        elif after:
            assert version == "step-1", "an answer to a request sent after the update returned names the old version"
        assert_matches(decode(response, 0), seqs, scorers["ref"] if model == "ref" else version_scorer[version])
    assert seen["policy"] == {first, "step-1"} and seen["ref"] == {ref_version}, seen

    # A stale pin is refused, naming the version served; the current one is served.
    seqs = random_sequences(np.random.default_rng(5), 2, VOCAB, lengths=(2, 30))
    stale = post(url, {"model": "policy", "sequences": seqs, "weights_version": first})
    assert stale.status_code == 409 and stale.json()["error"]["type"] == "weights_version_mismatch"
    assert "step-1" in stale.json()["error"]["message"]
    pinned = post(url, {"model": "policy", "sequences": seqs, "weights_version": "step-1"})
    assert pinned.status_code == 200
    assert_matches(decode(pinned, 0), seqs, scorers["step-1"])


def test_refused_updates_change_nothing(deployment):
    server, scorers = deployment["server"], deployment["scorers"]
    url = server.url
    before = served_versions(url)
    escapes = ["/etc", "../reference", "step-1/../../reference", "escape", ".."]
    for path in escapes:
        response = httpx.post(url + "/v1/weights", json={"model": "policy", "path": path}, headers=ADMIN, timeout=60)
        assert response.status_code == 403 and response.json()["error"]["type"] == "forbidden_path", (path, response.text)
    scoring_key = httpx.post(url + "/v1/weights", json={"model": "policy", "path": "step-0"}, headers=AUTH, timeout=60)
    assert scoring_key.status_code == 403
    admin_scoring = httpx.post(url + "/score", json={"model": "policy", "sequences": [{"input_ids": [1, 2]}]}, headers=ADMIN)
    assert admin_scoring.status_code == 403 and admin_scoring.json()["error"]["type"] == "forbidden", admin_scoring.text
    no_path = httpx.post(url + "/v1/weights", json={"model": "policy"}, headers=ADMIN, timeout=60)
    assert no_path.status_code == 422 and no_path.json()["error"] == {
        "type": "invalid_value", "message": "path is required.", "param": "path"}, no_path.text

    broken = httpx.post(url + "/v1/weights", json={"model": "policy", "path": "broken"}, headers=ADMIN, timeout=120)
    assert broken.status_code == 422 and broken.json()["error"]["type"] == "incomplete_checkpoint", broken.text
    assert deployment["dropped"] in broken.json()["error"]["message"]
    wider = httpx.post(url + "/v1/weights", json={"model": "policy", "path": "wider"}, headers=ADMIN, timeout=120)
    assert wider.status_code == 422 and wider.json()["error"]["type"] == "incompatible_checkpoint", wider.text
    assert wider.json()["error"]["param"] == "path" and "mlp" in wider.json()["error"]["message"], wider.text
    doubled = httpx.post(url + "/v1/weights", json={"model": "policy", "path": "doubled"}, headers=ADMIN, timeout=120)
    assert doubled.status_code == 422 and doubled.json()["error"]["type"] == "incomplete_checkpoint", doubled.text
    assert "second copy of" in doubled.json()["error"]["message"] and "layers.0.input_layernorm.weight" in doubled.text, doubled.text
    integer = httpx.post(url + "/v1/weights", json={"model": "policy", "path": "integer"}, headers=ADMIN, timeout=120)
    assert integer.status_code == 422 and integer.json()["error"]["type"] == "incompatible_checkpoint", integer.text
    assert "model.layers.0.input_layernorm.weight I32" in integer.json()["error"]["message"], integer.text
    assert served_versions(url) == before
    seqs = random_sequences(np.random.default_rng(6), 3, VOCAB, lengths=(2, 50))
    response = post(url, {"model": "policy", "sequences": seqs})
    assert response.status_code == 200 and response.json()["weights_version"] == before["policy"]
    current = scorers["step-1"] if before["policy"] == "step-1" else scorers["step-0"]
    assert_matches(decode(response, 0), seqs, current)


def test_mismatch_figures_and_the_client(deployment):
    server, scorers = deployment["server"], deployment["scorers"]
    rng = np.random.default_rng(7)
    seqs = random_sequences(rng, 4, VOCAB, lengths=(2, 50))
    want = scorers["ref"].score([SequenceInput(np.array(s["input_ids"]), s["score_from"]) for s in seqs])
    rollouts = [(w.logprobs + rng.normal(0, 0.3, w.logprobs.size)).astype(np.float32) for w in want]
    for encoding in ("json", "msgpack"):
        with ScoreClient(server.url, API_KEY, admin_key=ADMIN_KEY, encoding=encoding) as client:
            got = client.score([{**s, "rollout_logprobs": r} for s, r in zip(seqs, rollouts)], model="ref")
            for s, w, r, g in zip(seqs, want, rollouts, got):
                d = w.logprobs.astype(np.float64) - r.astype(np.float64)
                expected = {"mean_abs_diff": float(np.abs(d).mean()) if d.size else 0.0,
                            "max_abs_diff": float(np.abs(d).max()) if d.size else 0.0,
                            "k3_kl": float(np.mean(np.exp(d) - 1 - d)) if d.size else 0.0}
                for key, value in expected.items():
                    assert abs(g.mismatch[key] - value) <= TOL, f"{s['id']} {key}: {g.mismatch[key]} vs {value} (tol {TOL})"
                assert g.model == "ref" and g.weights_version == served_versions(server.url)["ref"]
            with pytest.raises(ScoreError) as stale:
                client.score(seqs[:1], model="ref", weights_version="not-served")
            assert stale.value.status == 409
    metrics = httpx.get(server.url + "/metrics", headers=AUTH).text
    assert 'packscore_rollout_k3_kl_count{model="ref"}' in metrics


def _forwards(url: str, model: str) -> float:
    for line in httpx.get(url + "/metrics", headers=AUTH, timeout=10).text.splitlines():
        if line.startswith(f'packscore_forward_seconds_count{{model="{model}"}}'):
            return float(line.split()[1])
    raise AssertionError(f"no forward count for {model}")


def _in_its_forward(url: str, server: ServerProcess) -> None:
    """Returns once a request sent in the background is admitted (its one row starts at once) and 0.2 s into its forward."""
    deadline = time.monotonic() + 60
    while queued_sequences(url) < 1:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.01)
    time.sleep(0.2)


def test_a_reference_request_past_its_deadline_behind_a_policy_forward_never_runs(tmp_path):
    # One forward at a time across the two models: the ref's row waits for the policy's long
    # forward; answered 504 meanwhile, it must not run after it (a forward for nobody). The
    # budget's 3-row floor (12,288 tokens) admits both requests whatever the measured rate.
    server = ServerProcess(tmp_path, "--model", "policy=tiny", "--model", "ref=tiny", "--max-batch-tokens", "4096",
                           "--max-wait-ms", "2")
    try:
        url = server.wait_ready(timeout=240).url
        ref_forwards = _forwards(url, "ref")
        sender, answers = post_in_background(url, {"model": "policy", **long_forward_body(0, sequences=1)})
        _in_its_forward(url, server)
        late = post(url, {"model": "ref", "sequences": [{"input_ids": [1, 2, 3]}], "deadline_ms": 300})
        sender.join(timeout=120)
        ref_after = _forwards(url, "ref")
    finally:
        assert server.stop() == 0, server.log()
    assert late.status_code == 504, late.text
    assert answers["answer"].status_code == 200, answers["answer"].text
    assert ref_after == ref_forwards, f"the ref ran {ref_after - ref_forwards:.0f} forward(s) for the request answered 504"


def test_no_weights_route_without_a_weights_root(tiny_server):
    response = httpx.post(tiny_server.url + "/v1/weights", json={"path": "x"}, headers=AUTH, timeout=30)
    assert response.status_code == 404
    error = response.json()["error"]
    # the trainer learns why, not only that the route is missing
    assert error["type"] == "not_found" and "--weights-root" in error["message"], error


def test_a_swap_right_after_a_one_row_request_is_scored_leaves_its_version(tmp_path):
    # The update arrives mid-forward and swaps as the forward ends, before the answer goes out: the
    # request was scored by one version, which it names, with no second forward (each would meet the next swap).
    root = tmp_path / "root"
    for seed in (0, 1):
        save_checkpoint("qwen3_5", root / f"step-{seed}", seed=seed)
    server = ServerProcess(tmp_path, "--model", f"policy={root / 'step-0'}", "--weights-root", str(root),
                           "--max-wait-ms", "2")
    rng = np.random.default_rng(0)
    body = {"sequences": [{"input_ids": rng.integers(0, VOCAB, 4000).tolist()} for _ in range(3)]}
    try:
        url = server.wait_ready(timeout=240).url
        before, forwards = served_versions(url)["policy"], _forwards(url, "policy")
        sender, answers = post_in_background(url, body)
        _in_its_forward(url, server)
        update = httpx.post(url + "/v1/weights", json={"model": "policy", "path": "step-1", "version": "v1"},
                            headers=AUTH, timeout=120)
        sender.join(timeout=120)
        forwards_after = _forwards(url, "policy")
    finally:
        assert server.stop() == 0, server.log()
    assert update.status_code == 200, update.text
    assert answers["answer"].status_code == 200, answers["answer"].text
    assert answers["answer"].json()["weights_version"] == before, server.log()
    assert forwards_after == forwards + 1, f"{forwards_after - forwards:.0f} forwards for a one-row request"
