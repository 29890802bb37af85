"""docs/gpu.md, the GPU quick start, says what the image does: the same torch and index, real
`packscore serve` options, the chart's documented install command."""

from __future__ import annotations

import re

from deploy_helpers import CLI_OPTIONS, REPO

GPU_DOC = (REPO / "docs" / "gpu.md").read_text()
DOCKERFILE = (REPO / "Dockerfile").read_text()


def _bash(markdown: str) -> list[str]:
    return [b.replace("\\\n", " ") for b in re.findall(r"```bash\n(.*?)```", markdown, re.DOTALL)]


def test_the_quick_start_installs_the_torch_the_image_installs():
    version = re.search(r"^ARG TORCH_VERSION=(\S+)$", DOCKERFILE, re.M).group(1)
    index = re.search(r"^ARG TORCH_INDEX_URL=(\S+)$", DOCKERFILE, re.M).group(1)
    installs = [line.strip() for block in _bash(GPU_DOC) for line in block.splitlines() if "pip install torch" in line]
    assert installs == [f".venv/bin/pip install torch=={version} --index-url {index}"], installs
    assert f"TORCH_VERSION={version}" in GPU_DOC and version in GPU_DOC.split("## Docker")[1]


def test_the_commands_use_real_options():
    for block in _bash(GPU_DOC):
        for line in block.splitlines():
            if "packscore serve" in line:
                flags = set(re.findall(r"(--[a-z-]+)", line.split("packscore serve", 1)[1]))
            elif "docker run" in line:
                flags = {a for a in line.split("packscore:0.1.0", 1)[1].split() if a.startswith("--")}
            else:
                continue
            assert flags and flags <= CLI_OPTIONS | {"--revision", "--served-model-name"}, flags
            assert "--api-key " not in line, "a key on the command line shows in ps"


def test_the_helm_install_is_the_deploy_readmes():
    deploy = (REPO / "deploy" / "README.md").read_text()
    ours = [b for b in _bash(GPU_DOC) if "helm install" in b]
    theirs = [b for b in _bash(deploy) if "helm install" in b]
    assert ours and ours == theirs
