"""The Dockerfile: hadolint-clean, built the way the issue and the README say, consistent with the chart.

No container engine runs here, so the image itself is not built by these tests.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tomllib

import pytest
import yaml

from deploy_helpers import CHART, REPO, find_tool, load_module
from service.cli import parse_settings

DOCKERFILE = REPO / "Dockerfile"
cuda_arch = load_module(REPO / "deploy" / "docker" / "cuda_arch.py")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        pending += " " + stripped
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        keyword, _, rest = pending.strip().partition(" ")
        out.append((keyword.upper(), rest.strip()))
        pending = ""
    assert not pending, "dangling line continuation"
    return out


def stages(text: str) -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, keyed by the stage name (`FROM ... AS name`)."""
    result: dict[str, list[tuple[str, str]]] = {}
    current = None
    for keyword, rest in instructions(text):
        if keyword == "FROM":
            m = re.fullmatch(r"(\S+)\s+AS\s+(\S+)", rest, re.IGNORECASE)
            assert m, f"every stage is named: FROM {rest}"
            current = m.group(2)
            result[current] = [(keyword, m.group(1))]
        elif current is not None:
            result[current].append((keyword, rest))
    return result


def args_of(stage: list[tuple[str, str]], keyword: str) -> list[str]:
    return [rest for k, rest in stage if k == keyword]


@pytest.fixture(scope="module")
def dockerfile() -> str:
    return DOCKERFILE.read_text()


def test_hadolint_is_clean():
    result = subprocess.run([find_tool("hadolint"), "--no-color", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_reports_problems(tmp_path):
    """Guards the check above against passing vacuously."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN cd /tmp && apt-get install curl\n")
    result = subprocess.run([find_tool("hadolint"), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert "DL3000" in result.stdout or "DL3003" in result.stdout, result.stdout


def test_two_stages_from_cuda_devel_and_cuda_runtime(dockerfile):
    s = stages(dockerfile)
    assert list(s) == ["build", "runtime"]
    args = {rest.split("=")[0]: rest.split("=", 1)[1] for k, rest in instructions(dockerfile)[:4] if k == "ARG"}
    image = {name: stage[0][1].replace("${CUDA_VERSION}", args["CUDA_VERSION"])
             .replace("${UBUNTU_VERSION}", args["UBUNTU_VERSION"]) for name, stage in s.items()}
    assert re.fullmatch(r"nvidia/cuda:12\.8\.\d+-cudnn-devel-ubuntu24\.04", image["build"]), image
    assert re.fullmatch(r"nvidia/cuda:12\.8\.\d+-runtime-ubuntu24\.04", image["runtime"]), image
    assert "nvcr.io/nvidia/pytorch" not in dockerfile


def test_build_stage_compiles_causal_conv1d_for_hopper(dockerfile):
    build = stages(dockerfile)["build"]
    env = " ".join(args_of(build, "ENV"))
    assert "TORCH_CUDA_ARCH_LIST=9.0" in args_of(build, "ARG")
    assert "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST}" in env
    assert "CAUSAL_CONV1D_FORCE_BUILD=TRUE" in env  # never fetch a prebuilt wheel
    run = " ".join(args_of(build, "RUN"))
    assert "cuda_arch.py patch" in run and "cuda_arch.py check" in run
    assert "pip wheel --no-deps --no-build-isolation" in run


def test_runtime_installs_a_cuda_torch_then_the_project_with_the_gpu_extra(dockerfile):
    runtime = stages(dockerfile)["runtime"]
    run = args_of(runtime, "RUN")
    torch_step = next(i for i, r in enumerate(run) if "pip install torch==" in r)
    assert re.search(r"pip install torch==\$\{TORCH_VERSION\} --index-url \$\{TORCH_INDEX_URL\}", run[torch_step])
    defaults = dict(a.split("=", 1) for a in args_of(runtime, "ARG"))
    assert defaults["TORCH_VERSION"] == "2.11.0"
    assert defaults["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cu128"
    wheel_step = next(i for i, r in enumerate(run) if "causal_conv1d-*.whl" in r)
    project_step = next(i for i, r in enumerate(run) if '"/src[gpu]"' in r)
    assert torch_step < wheel_step < project_step
    assert "from=build" in run[wheel_step]


def test_install_steps_match_the_readme_and_the_gpu_extra(dockerfile):
    readme = (REPO / "README.md").read_text()
    assert "'.[gpu]'" in readme and "CUDA build of torch first" in readme
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    gpu = " ".join(extras["gpu"])
    assert "flash-linear-attention" in gpu and "causal-conv1d" in gpu


def test_runtime_runs_packscore_serve_as_uid_1000(dockerfile):
    runtime = stages(dockerfile)["runtime"]
    assert args_of(runtime, "USER") == ["1000:1000"]
    assert json.loads(args_of(runtime, "ENTRYPOINT")[0])[-2:] == ["packscore", "serve"]
    assert args_of(runtime, "EXPOSE") == ["8000"]
    assert "useradd --uid 1000" in " ".join(args_of(runtime, "RUN"))
    # USER comes after every RUN, so nothing at run time has root's rights.
    keywords = [k for k, _ in runtime]
    assert max(i for i, k in enumerate(keywords) if k == "RUN") < keywords.index("USER")


def test_tini_is_the_init_reaping_orphans_and_passing_signals_and_exit_status_through(dockerfile):
    # packscore as PID 1 never reaps a dead worker's orphaned children; tini does, as PID 1 or (-s) under another init.
    runtime = stages(dockerfile)["runtime"]
    entrypoint = json.loads(args_of(runtime, "ENTRYPOINT")[0])
    assert entrypoint[0] == "/usr/bin/tini", entrypoint  # where Ubuntu's tini package installs it
    end = entrypoint.index("--")
    assert entrypoint[end + 1:] == ["packscore", "serve"]  # docker run's arguments still go to packscore serve
    flags = entrypoint[1:end]
    assert "-s" in flags
    assert "-g" not in flags  # SIGTERM to packscore alone: it drains, then stops its workers itself
    assert not any(f.startswith("-e") for f in flags)  # exit statuses unchanged (0 drained, 2 refused checkpoint)
    installs = [r for r in args_of(runtime, "RUN") if "apt-get install" in r]
    assert any(re.search(r"--no-install-recommends .*\btini\b", r) for r in installs), installs
    readme = (REPO / "deploy" / "README.md").read_text()
    assert f"`ENTRYPOINT {json.dumps(entrypoint)}`" in readme


def _documented_runs_off_the_entrypoint() -> dict[str, list[list[str]]]:
    """Each doc page's `docker run`s that replace the entrypoint or run `packscore score`, as argument lists."""
    pages = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    runs: dict[str, list[list[str]]] = {}
    for page in pages:
        for run in re.findall(r"docker run [^`\n]*", page.read_text().replace("\\\n", " ")):
            if "--entrypoint" in run or "packscore score" in run or re.search(r"(IMAGE|packscore:\S+) score\b", run):
                runs.setdefault(str(page.relative_to(REPO)), []).append(shlex.split(run))
    return runs


def test_offline_scoring_in_the_image_keeps_tini_as_pid_1(dockerfile):
    entrypoint = json.loads(args_of(stages(dockerfile)["runtime"], "ENTRYPOINT")[0])
    # It ends in `packscore serve`, so `docker run IMAGE score IN -o OUT` would run `packscore serve score ...`,
    assert entrypoint[-1] == "serve"
    with pytest.raises(SystemExit):
        parse_settings(["serve", "score", "in.jsonl", "-o", "out.jsonl"])
    # and `--entrypoint packscore` leaves no init to reap orphans: the docs replace it with tini and tini's flags.
    init = entrypoint[:entrypoint.index("--") + 1]
    runs = _documented_runs_off_the_entrypoint()
    assert {"deploy/README.md", "docs/deployment.md", "docs/cli.md"} <= set(runs), sorted(runs)
    for page, argv in ((p, a) for p, found in runs.items() for a in found):
        assert "--entrypoint" in argv and argv[argv.index("--entrypoint") + 1] == init[0], (page, argv)
        (image,) = [i for i, a in enumerate(argv) if a == "IMAGE" or a.startswith("packscore:")]
        command = argv[image + 1:]
        assert command[:len(init)] == [*init[1:], "packscore"], (page, argv)
        args, _ = parse_settings(command[len(init):])
        assert args.command == "score" and args.output is not None, (page, argv)


def test_healthcheck_polls_healthz(dockerfile):
    (check,) = args_of(stages(dockerfile)["runtime"], "HEALTHCHECK")
    assert "/healthz" in check and "PACKSCORE_PORT" in check
    assert re.search(r"--start-period=\d+", check)


def test_triton_cache_directory_is_writable_and_shared_with_the_chart(dockerfile):
    runtime = stages(dockerfile)["runtime"]
    env = " ".join(args_of(runtime, "ENV"))
    assert "TRITON_CACHE_DIR=/cache/triton" in env
    assert "mkdir -p /cache/triton" in " ".join(args_of(runtime, "RUN"))
    assert "chown -R 1000:1000 /cache" in " ".join(args_of(runtime, "RUN"))
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["podSecurityContext"]["runAsUser"] == 1000
    assert values["server"]["port"] == 8000
    deployment = (CHART / "templates" / "deployment.yaml").read_text()
    assert "mountPath: /cache\n" in deployment and "/cache/triton" in deployment


def test_every_cache_directory_is_writable_by_any_uid(dockerfile):
    # `docker run --user 2000` (and a new named volume, which Docker fills from the image's directory) must write them.
    runtime = stages(dockerfile)["runtime"]
    run = " ".join(args_of(runtime, "RUN"))
    env = dict(v.split("=", 1) for v in shlex.split(" ".join(args_of(runtime, "ENV"))) if "=" in v)
    caches = {env[k] for k in ("TRITON_HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "PACKSCORE_TRITON_CACHE_DIR")}
    created = {d for m in re.findall(r"mkdir -p ((?:/\S+ ?)+)", run) for d in m.split() if d.startswith("/cache")}
    assert caches <= created | {"/cache"}, (caches, created)
    (modes,) = re.findall(r"chmod 1777 ((?:/\S+ ?)+)", run)
    assert set(modes.split()) == created | {"/cache"}, modes  # sticky like /tmp: no uid removes another's files


def test_the_home_and_working_directory_is_readable_by_any_uid(dockerfile):
    # useradd --create-home makes it 0750 on Ubuntu: `docker run --user 2000` could not read its working directory.
    runtime = stages(dockerfile)["runtime"]
    env = dict(v.split("=", 1) for v in shlex.split(" ".join(args_of(runtime, "ENV"))) if "=" in v)
    (workdir,) = args_of(runtime, "WORKDIR")
    (created,) = [r for r in args_of(runtime, "RUN") if "useradd" in r]
    assert f"--create-home --home-dir {workdir} " in created and env["HOME"] == workdir, (created, env["HOME"])
    after = created.partition("useradd")[2]
    assert re.search(rf"chmod 0?755 {re.escape(workdir)}(\s|$)", after), created  # after useradd, in its layer


def _dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    """(negated, regex) for the subset of .dockerignore syntax used here: *, ** and ! lines."""
    rules = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex += "(?:.*/)?"
                i += 3
            elif pattern[i] == "*":
                regex += "[^/]*"
                i += 1
            else:
                regex += re.escape(pattern[i])
                i += 1
        rules.append((negate, re.compile(regex)))
    return rules


def in_context(path: str) -> bool:
    """Docker's rule: the last matching pattern decides; a pattern on a folder covers its contents."""
    parts = path.split("/")
    included = True
    for negate, regex in _dockerignore_patterns():
        if any(regex.fullmatch("/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            included = negate
    return included


@pytest.mark.parametrize("path", [
    "pyproject.toml", "README.md", "model_runtime/model/causal_lm.py", "service/cli.py", "deploy/docker/cuda_arch.py",
])
def test_dockerignore_keeps_what_the_build_reads(path):
    assert in_context(path)


@pytest.mark.parametrize("path", [
    ".venv/bin/python", ".git/HEAD", "tests/unit/test_x.py", "bench/run.py", "build/x.whl",
    "model_runtime/__pycache__/model.cpython-311.pyc", "packscore.egg-info/PKG-INFO", "Dockerfile",
    "deploy/helm/packscore/values.yaml", "models/Qwen3.5-9B/model.safetensors",
])
def test_dockerignore_leaves_out_everything_else(path):
    assert not in_context(path)


def test_every_copied_path_is_in_the_build_context(dockerfile):
    for keyword, rest in instructions(dockerfile):
        if keyword == "COPY" and "--from=" not in rest:
            *sources, _dest = rest.split()
            for source in sources:
                assert (REPO / source).exists() and in_context(source), source


# cuda_arch.py: runs inside the build stage, so it is tested here on a stand-in setup.py
# shaped like causal-conv1d's (pairs of cc_flag.append lines inside version checks).
FAKE_SETUP = '''
cc_flag = []
if True:
    cc_flag.append("-gencode")
    cc_flag.append("arch=compute_80,code=sm_80")
    if bare_metal_version >= 11.8:
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_90,code=sm_90")
    if bare_metal_version >= 12.8:
        cc_flag.append("-gencode")
        cc_flag.append("arch=compute_100,code=sm_100")
'''


def _flags(source: str, version: float) -> list[str]:
    scope = {"bare_metal_version": version}
    exec(compile(source, "setup.py", "exec"), scope)
    return scope["cc_flag"]


@pytest.mark.parametrize(("arch_list", "expected"), [
    ("9.0", {"90"}), ("8.0;9.0", {"80", "90"}), ("9.0+PTX", {"90"}), (" 9.0 10.0 ", {"90", "100"}), ("9.0a", {"90a"}),
])
def test_cuda_arch_list_parsing(arch_list, expected):
    assert cuda_arch.parse_arch_list(arch_list) == expected


@pytest.mark.parametrize("arch_list", ["", "sm_90", "9"])
def test_cuda_arch_list_rejects_nonsense(arch_list):
    with pytest.raises(ValueError):
        cuda_arch.parse_arch_list(arch_list)


def test_patch_keeps_only_hopper_and_stays_valid_python(tmp_path):
    setup = tmp_path / "setup.py"
    setup.write_text(FAKE_SETUP)
    cuda_arch.patch(setup, "9.0")
    assert _flags(setup.read_text(), 12.8) == ["-gencode", "arch=compute_90,code=sm_90"]
    assert _flags(FAKE_SETUP, 12.8) == ["-gencode", "arch=compute_80,code=sm_80", "-gencode",
                                        "arch=compute_90,code=sm_90", "-gencode", "arch=compute_100,code=sm_100"]
    cuda_arch.patch(setup, "9.0")  # idempotent
    assert _flags(setup.read_text(), 12.8) == ["-gencode", "arch=compute_90,code=sm_90"]


def test_patch_fails_loudly_when_the_wanted_arch_is_missing(tmp_path):
    setup = tmp_path / "setup.py"
    setup.write_text(FAKE_SETUP)
    with pytest.raises(SystemExit, match="no gencode pair for sm_89"):
        cuda_arch.patch(setup, "8.9")
    assert setup.read_text() == FAKE_SETUP  # untouched


def test_elf_listing_names_the_architectures():
    listing = "ELF file    1: causal_conv1d_cuda.1.sm_90.cubin\nELF file    2: causal_conv1d_cuda.2.sm_90.cubin\n"
    assert cuda_arch.arches_in_listing(listing) == {"90"}
    assert cuda_arch.arches_in_listing(listing + "ELF file    3: x.3.sm_100.cubin\n") == {"90", "100"}


def test_every_build_argument_is_documented_with_its_default(dockerfile):
    readme = (REPO / "deploy" / "README.md").read_text()
    documented = dict(re.findall(r"^\| `([A-Z_0-9]+)` \| `([^`]*)` \|", readme, re.MULTILINE))
    declared: dict[str, str] = {}
    for keyword, rest in instructions(dockerfile):
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            assert declared.setdefault(name, default) == default, f"ARG {name} has two defaults"
    assert declared == documented, f"Dockerfile {declared} != deploy/README.md {documented}"
