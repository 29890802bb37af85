"""With weight updates on, the chart adds a headless Service whose name resolves to every pod, the
ready and the not ready, so a trainer can send each pod its update (chart README, Weight updates)."""

from __future__ import annotations

import pytest

from deploy_helpers import NAMESPACE, RELEASE, arg_value, by_kind, container, manifests, one, render_chart

FULLNAME = f"{RELEASE}-packscore"
WEIGHTS = {"enabled": True, "mountPath": "/ckpt", "source": {"type": "pvc", "pvc": {"claimName": "rl"}}}


def services(values: dict) -> dict[str, dict]:
    return {s["metadata"]["name"]: s for s in by_kind(manifests(values), "Service")}


def test_weight_updates_add_a_headless_service_of_every_pod():
    svcs = services({"weights": WEIGHTS, "service": {"type": "ClusterIP", "port": 8080}})
    assert set(svcs) == {FULLNAME, f"{FULLNAME}-pods"}
    main, pods = svcs[FULLNAME], svcs[f"{FULLNAME}-pods"]
    assert pods["metadata"]["namespace"] == NAMESPACE
    assert pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["publishNotReadyAddresses"] is True  # a pod updating in place is NotReady
    assert pods["spec"]["selector"] == main["spec"]["selector"]
    assert main["spec"]["ports"] == [{"name": "http", "port": 8080, "targetPort": "http", "protocol": "TCP"}]
    # Its name resolves to pod IPs, connected to directly: the port is the pods' (server.port), not service.port.
    assert pods["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert "type" not in pods["spec"]  # headless whatever service.type is
    dep = one(manifests({"weights": WEIGHTS}), "Deployment")
    assert pods["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_no_headless_service_without_weight_updates():
    assert list(services({})) == [FULLNAME]
    assert list(services({"weights": {**WEIGHTS, "enabled": False}})) == [FULLNAME]


def test_a_long_release_name_keeps_the_headless_name_a_dns_label():
    names = services({"fullnameOverride": "x" * 63, "weights": WEIGHTS})
    assert sorted(len(n) for n in names) == [63, 63]
    assert ("x" * 58 + "-pods") in names


def test_the_service_monitor_scrapes_each_pod_once_through_the_main_service():
    docs = manifests({"weights": WEIGHTS, "serviceMonitor": {"enabled": True}})
    selector = one(docs, "ServiceMonitor")["spec"]["selector"]

    def selected(svc: dict) -> bool:
        labels = svc["metadata"]["labels"]
        exprs_ok = all((e["key"] in labels) == (e["operator"] == "Exists") for e in selector.get("matchExpressions", []))
        return selector["matchLabels"].items() <= labels.items() and exprs_ok

    assert [s["metadata"]["name"] for s in by_kind(docs, "Service") if selected(s)] == [FULLNAME]


@pytest.mark.parametrize("port", [8000, 9000])
def test_notes_name_the_headless_service_at_the_pods_port(port):
    values = {"weights": WEIGHTS, "service": {"type": "ClusterIP", "port": 80}, "server": {"port": port}}
    notes = render_chart(values)["packscore/templates/NOTES.txt"]
    assert f"http://{FULLNAME}-pods.{NAMESPACE}.svc:{port} resolves" in notes, notes
    (pods,) = [s for s in by_kind(manifests(values), "Service") if s["metadata"]["name"] == f"{FULLNAME}-pods"]
    assert [p["port"] for p in pods["spec"]["ports"]] == [port]
    # Clients connect to pod IP:port (update_weights_everywhere keeps the URL's port): it must be the port the
    # server listens on, which targetPort http names too.
    (http,) = [p for p in container(values)["ports"] if p["name"] == pods["spec"]["ports"][0]["targetPort"]]
    assert http["containerPort"] == port == int(arg_value(container(values)["args"], "--port"))
    assert "update_weights_everywhere" in notes
