"""docs/client.md's trainer recipe, run as written against a real server: a verl-style padded batch
of numpy arrays -> reference log-probs aligned with the response mask -> the k3 KL. Also README.md's
client examples, packscore_client's docstring example, docs/client.md's ``score`` block, the curl
request of README.md and docs/usage.md with the answer they show, and docs/weights.md's serve and
update commands with the answer shown."""

from __future__ import annotations

import doctest
import json
import re
from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import packscore_client
import pytest

from model_runtime.types import SequenceInput
from tests.e2e.helpers import API_KEY, TINY_VOCAB, TOL

DOC = Path(__file__).resolve().parents[2] / "docs" / "client.md"


def recipe() -> str:
    """The python block that follows the ``<!-- recipe`` marker in docs/client.md."""
    text = DOC.read_text()
    match = re.search(r"<!-- recipe[^>]*-->\s*```python\n(.*?)```", text, re.S)
    assert match, "docs/client.md has no recipe block"
    return match.group(1)


def verl_batch(rng: np.random.Generator, prompts: list[int], responses: list[int], pad_id: int = 0) -> dict:
    """Prompts left-padded to the longest, responses right-padded, as verl's rollout writes them."""
    P, R = max(prompts), max(responses)
    batch = {"input_ids": np.full((len(prompts), P + R), pad_id, np.int64),
             "attention_mask": np.zeros((len(prompts), P + R), np.int64),
             "response_mask": np.zeros((len(prompts), R), np.int64)}
    for b, (p, r) in enumerate(zip(prompts, responses)):
        batch["input_ids"][b, P - p : P + r] = rng.integers(1, TINY_VOCAB, p + r)
        batch["attention_mask"][b, P - p : P + r] = 1
        batch["response_mask"][b, :r] = 1
    return batch


def test_the_documented_recipe_runs_as_written(tiny_server, tiny_scorer, monkeypatch):
    rng = np.random.default_rng(21)
    prompts, responses = [7, 3, 12, 5, 9], [10, 4, 1, 13, 6]
    batch = verl_batch(rng, prompts, responses)
    batch["response_mask"][3, 5:8] = 0  # a masked span inside a response (a tool's output)
    P, mask = max(prompts), batch["response_mask"].astype(bool)

    # What the server must answer: each row alone, without its pads, in this process.
    want = np.zeros(mask.shape, np.float32)
    want_entropy = np.zeros(mask.shape, np.float32)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        ids = batch["input_ids"][b, P - p : P + r]
        (s,) = tiny_scorer.score([SequenceInput(ids, p, 1.0, 0, True)])
        want[b, :r], want_entropy[b, :r] = s.logprobs, s.entropy
    want[~mask] = want_entropy[~mask] = 0
    old_log_prob = np.where(mask, want + rng.normal(0, 0.1, mask.shape), 0).astype(np.float32)

    monkeypatch.setenv("PACKSCORE_URL", tiny_server.url)
    monkeypatch.setenv("PACKSCORE_API_KEY", API_KEY)
    scope = {"batch": batch, "old_log_prob": old_log_prob}
    exec(compile(recipe(), str(DOC), "exec"), scope)

    got, got_entropy = scope["ref_log_prob"], scope["ref_entropy"]
    assert got.shape == mask.shape and got.dtype == np.float32
    diff = float(np.max(np.abs(got - want)))
    assert diff <= TOL, f"reference log-probs: max |diff| {diff} > {TOL}"
    diff = float(np.max(np.abs(got_entropy - want_entropy)))
    assert diff <= TOL, f"entropy: max |diff| {diff} > {TOL}"
    assert not got[~mask].any() and not got_entropy[~mask].any(), "non-zero where response_mask is 0"
    delta = want - old_log_prob
    kl = float((np.clip(np.exp(delta) - delta - 1, -10, 10) * mask).sum() / mask.sum())
    assert abs(scope["kl"] - kl) <= 1e-5, (scope["kl"], kl)
    assert scope["kl"] > 0


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), re.S)


def _shape(value):
    """A JSON value's form: the keys of an object, the length of a list, the type of a scalar."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


def _numbers(value) -> list[float]:
    if isinstance(value, dict):
        return [x for k in sorted(value) for x in _numbers(value[k])]
    if isinstance(value, list):
        return [x for v in value for x in _numbers(v)]
    return [float(value)] if isinstance(value, (int, float)) and not isinstance(value, bool) else []


def _curl(command: str, variables: dict[str, str]) -> tuple[str, dict[str, str], str]:
    """A documented curl command's URL, headers (``variables`` put in) and ``-d`` body, as the shell passes them."""
    command = command.split("curl ", 1)[1].replace("\\\n", " ")
    url = re.search(r"https?://\S+", command).group(0)
    pairs = re.findall(r"-H (?:'([^']*)'|\"([^\"]*)\")", command)  # -H 'single' or -H "double" quoted
    headers = {}
    for single, double in pairs:
        text = single or double
        if double:  # the shell expands $VAR inside "..." only
            for name, value in variables.items():
                text = text.replace(name, value)
        key, _, value = text.partition(": ")
        headers[key] = value
    return url, headers, re.search(r"-d '([^']*)'", command).group(1)


@pytest.mark.parametrize("doc", ["README.md", "docs/usage.md"])
def test_the_documented_curl_request_gets_the_answer_shown(tiny_server, doc):
    """The first ``curl .../score`` of the page, sent as written (its headers and body, $KEY the API
    key), answers the JSON block shown after it: the same fields, shapes and strings, numbers within
    the CPU's float32 tolerance."""
    path = Path(__file__).resolve().parents[2] / doc
    command = next(b for b in _blocks(path, "bash") if "curl -s http://127.0.0.1:8000/score" in b)
    url, headers, body = _curl(command, {"$KEY": API_KEY})
    answer = next(b for b in _blocks(path, "json") if '"results"' in b)
    shown = json.loads(answer)

    response = httpx.post(url.replace("http://127.0.0.1:8000", tiny_server.url), content=body, headers=headers)
    assert response.status_code == 200, response.text
    got = response.json()
    assert _shape(got) == _shape(shown), f"{doc}: the server answers {_shape(got)}"
    assert [x for x in _numbers(got) if x == int(x)] == [x for x in _numbers(shown) if x == int(x)]  # ids, counts
    assert got["model"] == shown["model"] and got["weights_version"] == shown["weights_version"]
    diff = max(abs(a - b) for a, b in zip(_numbers(got), _numbers(shown)))
    assert diff <= TOL, f"{doc}'s shown numbers are {diff} from the server's: {response.text}"


def test_the_readme_client_examples_run_as_written(tiny_server, tiny_scorer):
    """README.md's two python blocks ("The API in brief"), against the real server: a trainer's
    rollouts by their prompt and response ids, then a padded batch and its k3 KL."""
    readme = Path(__file__).resolve().parents[2] / "README.md"
    first, padded = _blocks(readme, "python")[:2]
    assert first.count('"http://packscore-ref:8000"') == 1
    rng = np.random.default_rng(5)
    rollouts = [SimpleNamespace(uid=f"r{i}", prompt_ids=rng.integers(1, TINY_VOCAB, p),
                                response_ids=rng.integers(1, TINY_VOCAB, r)) for i, (p, r) in enumerate([(5, 3), (2, 7)])]
    scope = {"KEY": API_KEY, "batch": rollouts}
    exec(compile(first.replace("http://packscore-ref:8000", tiny_server.url), str(readme), "exec"), scope)
    for r, logp in zip(rollouts, scope["ref_logp"]):
        ids = np.concatenate([r.prompt_ids, r.response_ids])
        (want,) = tiny_scorer.score([SequenceInput(ids, len(r.prompt_ids), 1.0, 0, True)])
        assert logp.dtype == np.float32 and logp.shape == r.response_ids.shape  # one per response token
        assert float(np.max(np.abs(logp - want.logprobs))) <= TOL

    batch = verl_batch(rng, [7, 3], [4, 6])
    old_log_prob = np.zeros(batch["response_mask"].shape, np.float32)
    scope.update(batch=batch, old_log_prob=old_log_prob)
    exec(compile(padded, str(readme), "exec"), scope)
    delta, mask = scope["delta"], batch["response_mask"].astype(bool)
    assert delta.dtype == np.float32 and delta.shape == mask.shape and not delta[~mask].any()  # [B, R], 0 where the mask is 0
    assert np.isfinite(scope["kl"]) and scope["kl"] > 0


def test_the_client_package_docstring_example_runs_as_written(tiny_server):
    """``packscore_client``'s module docstring, run as a doctest against the real server (its URL and
    key put in) in the module's namespace, as doctest runs it, on a trainer's padded batch."""
    text = packscore_client.__doc__
    assert text.count('"http://127.0.0.1:8000", api_key=None') == 1
    text = text.replace('"http://127.0.0.1:8000", api_key=None', f'"{tiny_server.url}", api_key={API_KEY!r}')
    batch = verl_batch(np.random.default_rng(8), [4, 6], [3, 2])
    test = doctest.DocTestParser().get_doctest(text, {**vars(packscore_client), **batch}, "packscore_client", None, 0)
    runner = doctest.DocTestRunner()
    runner.run(test)
    assert runner.summarize(verbose=False) == doctest.TestResults(failed=0, attempted=5)


def test_the_client_score_example_runs_as_written(tiny_server):
    """docs/client.md's ``score`` block ("Sequences without padding"): the arrays it names, of the
    dtypes and shapes its comment gives."""
    page = Path(__file__).resolve().parents[2] / "docs" / "client.md"
    block = next(b for b in _blocks(page, "python") if "out = ref.score(" in b)
    prompt, ids = [5, 6, 7], np.array([5, 6, 7, 8, 9, 10, 11])
    with packscore_client.ScoreClient(tiny_server.url, api_key=API_KEY) as ref:
        scope = {"ref": ref, "ids": ids, "prompt": prompt}
        exec(compile(block, str(page), "exec"), scope)
    logprobs, entropy, top_k_ids = scope["out"][0].logprobs, scope["out"][0].entropy, scope["out"][0].top_k_ids
    n = len(ids) - len(prompt)
    assert (logprobs.dtype, logprobs.shape) == (np.float32, (n,))
    assert (entropy.dtype, entropy.shape) == (np.float32, (n,))
    assert (top_k_ids.dtype, top_k_ids.shape) == (np.int32, (n, 5))


def test_the_weights_pages_serve_and_update_commands_get_the_answer_shown(tmp_path):
    """docs/weights.md's two shell blocks as written, /ckpt and the admin key's file put in: the
    serve command of a policy beside its reference, then the curl update, answered as its comment shows."""
    import shlex

    from tests.checkpoints import save_checkpoint
    from tests.e2e.helpers import ServerProcess

    page = Path(__file__).resolve().parents[2] / "docs" / "weights.md"
    serve, update = (next(b for b in _blocks(page, "sh") if mark in b) for mark in ("packscore serve", "/v1/weights"))
    root, secret = tmp_path / "ckpt", tmp_path / "packscore-admin"
    args = shlex.split(serve.replace("\\\n", " ").replace("/ckpt", str(root)).replace("/run/secrets/packscore-admin", str(secret)))
    assert args[:2] == ["packscore", "serve"], args
    for name in ("step-000000", "reference", "step-000120"):
        save_checkpoint("qwen3_5", root / name, seed=len(name))
    secret.write_text("e2e-admin\n")
    server = ServerProcess(tmp_path, *args[2:])
    try:
        server.wait_ready(timeout=240)
        url, headers, body = _curl(update, {"$ADMIN_KEY": "e2e-admin"})
        response = httpx.post(url.replace("http://scorer:8000", server.url), content=body, headers=headers, timeout=120)
        status, shown = re.search(r"# (\d{3}) (\{.*\})", update).groups()
        assert response.status_code == int(status), response.text
        got, shown = response.json(), json.loads(shown)
        assert _shape(got) == _shape(shown), f"the server answers {_shape(got)}"
        assert (got["model"], got["weights_version"]) == (shown["model"], shown["weights_version"])
        versions = {m["id"]: m["weights_version"] for m in httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()["data"]}
        assert versions["policy"] == "step-120" and set(versions) == {"policy", "ref"}, versions
    finally:
        assert server.stop() == 0, server.log()
