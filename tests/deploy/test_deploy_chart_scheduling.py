"""Where the chart's pods may run: GPU feature discovery's product label, the user's own node rules."""

from __future__ import annotations

import pytest
import yaml

from deploy_helpers import CHART, pod_spec

PRODUCT = "nvidia.com/gpu.product"
# GPU feature discovery's label: NVML's device name with each space replaced by "-".
H200_SXM, H200_NVL, H100_SXM = "NVIDIA-H200", "NVIDIA-H200-NVL", "NVIDIA-H100-80GB-HBM3"


def schedulable(spec: dict, labels: dict[str, str]) -> bool:
    """Whether the scheduler's node rules admit a node with these labels: nodeSelector, then the
    required node affinity (its terms ORed, each term's expressions ANDed)."""
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = spec.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is None:
        return True
    ops = {"In": lambda e: labels.get(e["key"]) in e["values"], "NotIn": lambda e: labels.get(e["key"]) not in e["values"],
           "Exists": lambda e: e["key"] in labels, "DoesNotExist": lambda e: e["key"] not in labels}
    return any(all(ops[e["operator"]](e) for e in term["matchExpressions"]) for term in required["nodeSelectorTerms"])


def test_scheduled_onto_h200_sxm_and_nvl_nodes_only():
    spec = pod_spec()
    for product, fits in [(H200_SXM, True), (H200_NVL, True), (H100_SXM, False), (f"{H200_SXM}-SHARED", False)]:
        assert schedulable(spec, {PRODUCT: product}) is fits, (product, spec.get("nodeSelector"), spec.get("affinity"))
    assert not schedulable(spec, {})  # no GPU feature discovery label: not a known H200 node
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert "runtimeClassName" not in spec
    assert pod_spec({"runtimeClassName": "nvidia"})["runtimeClassName"] == "nvidia"
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["gpuProducts"] == [H200_SXM, H200_NVL] and values["nodeSelector"] == {}


def test_own_required_node_terms_keep_the_gpu_product_rule_and_other_affinity_passes_through():
    anti = {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 100, "podAffinityTerm": {
        "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "x"}}}}]}
    pools = [{"matchExpressions": [{"key": "pool", "operator": "In", "values": ["rl"]}]},
             {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["spare"]}]}]
    affinity = {"podAntiAffinity": anti, "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": pools},
        "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": pools[1]}]}}
    spec = pod_spec({"affinity": affinity, "nodeSelector": {"zone": "a"}})
    assert spec["affinity"]["podAntiAffinity"] == anti
    assert spec["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == [
        {"weight": 1, "preference": pools[1]}]
    for pool in ["rl", "spare"]:  # every ORed term carries the product rule
        assert schedulable(spec, {"zone": "a", "pool": pool, PRODUCT: H200_NVL})
        assert not schedulable(spec, {"zone": "a", "pool": pool, PRODUCT: H100_SXM})
    assert not schedulable(spec, {"zone": "b", "pool": "rl", PRODUCT: H200_SXM})  # the nodeSelector still applies
    assert not schedulable(spec, {"zone": "a", "pool": "other", PRODUCT: H200_SXM})


@pytest.mark.parametrize("values", [
    pytest.param({"nodeSelector": {PRODUCT: H100_SXM}}, id="nodeSelector"),
    pytest.param({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": PRODUCT, "operator": "In", "values": [H100_SXM]}]}]}}}}, id="affinity"),
    pytest.param({"gpuProducts": [H100_SXM]}, id="gpuProducts"),
])
def test_a_gpu_product_of_ones_own_replaces_the_default(values):
    spec = pod_spec(values)
    assert schedulable(spec, {PRODUCT: H100_SXM})
    assert not schedulable(spec, {PRODUCT: H200_SXM})


def test_no_gpu_products_means_no_product_rule():
    spec = pod_spec({"gpuProducts": []})
    assert "affinity" not in spec and "nodeSelector" not in spec
    assert schedulable(spec, {PRODUCT: H100_SXM}) and schedulable(spec, {})
