"""With weights.enabled, the chart mounts a read-only weights root, an admin key file and a writable
record of the last update, and its notes say where updates go (chart README, Weight updates)."""

from __future__ import annotations

from pathlib import Path

import helm_python as helm
import pytest

from deploy_helpers import arg_value, container, pod_spec, render_chart
from service.cli import parse_settings


def test_notes_tell_where_weight_updates_go_and_that_each_pod_takes_its_own():
    weights = {"enabled": True, "mountPath": "/ckpt", "source": {"type": "pvc", "pvc": {"claimName": "rl"}},
               "adminKey": {"secretName": "ps-admin"}}
    notes = render_chart({"weights": weights})["packscore/templates/NOTES.txt"]
    assert "POST /v1/weights with a path relative to /ckpt, authorised by the admin key in Secret ps-admin." in notes
    assert "send it to each pod" in notes
    del weights["adminKey"]
    assert "authorised by the API key." in render_chart({"weights": weights})["packscore/templates/NOTES.txt"]


WEIGHT_SOURCES = [
    pytest.param({"type": "pvc", "pvc": {"claimName": "rl-checkpoints"}},
                 {"persistentVolumeClaim": {"claimName": "rl-checkpoints", "readOnly": True}}, id="pvc"),
    pytest.param({"type": "hostPath", "hostPath": {"path": "/mnt/ckpt", "type": "Directory"}},
                 {"hostPath": {"path": "/mnt/ckpt", "type": "Directory"}}, id="hostPath"),
    pytest.param({"type": "nfs", "nfs": {"server": "10.0.0.5", "path": "/export/ckpt"}},
                 {"nfs": {"server": "10.0.0.5", "path": "/export/ckpt", "readOnly": True}}, id="nfs"),
]


def test_weight_updates_are_off_by_default():
    spec = pod_spec()
    (c,) = spec["containers"]
    assert not {"--weights-root", "--admin-key", "--admin-key-file"} & set(c["args"])
    assert not {"weights", "admin-key"} & {v["name"] for v in spec["volumes"]}
    assert parse_settings(["serve", *c["args"]])[1].weights_root is None


@pytest.mark.parametrize(("source", "volume_source"), WEIGHT_SOURCES)
def test_weights_volume_is_mounted_read_only_as_the_weights_root(source, volume_source):
    spec = pod_spec({"weights": {"enabled": True, "mountPath": "/ckpt", "source": source}})
    (c,) = spec["containers"]
    assert arg_value(c["args"], "--weights-root") == "/ckpt"
    assert parse_settings(["serve", *c["args"]])[1].weights_root == Path("/ckpt")
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "weights"]
    assert mount == {"name": "weights", "mountPath": "/ckpt", "readOnly": True}
    (volume,) = [v for v in spec["volumes"] if v["name"] == "weights"]
    assert volume == {"name": "weights", **volume_source}
    assert "--admin-key-file" not in c["args"]  # no admin key: the API key rules /v1/weights


def test_weights_pvc_sub_path_is_mounted():
    spec = pod_spec({"weights": {"enabled": True, "source": {"type": "pvc", "pvc": {"claimName": "c", "subPath": "run7"}}}})
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "weights"]
    assert mount == {"name": "weights", "mountPath": "/weights", "readOnly": True, "subPath": "run7"}


def test_admin_key_is_a_mounted_secret_file_passed_as_admin_key_file():
    spec = pod_spec({"weights": {"enabled": True, "source": WEIGHT_SOURCES[0].values[0],
                                 "adminKey": {"secretName": "ps-admin", "secretKey": "token"}}})
    (c,) = spec["containers"]
    key_file = arg_value(c["args"], "--admin-key-file")
    assert "--admin-key" not in c["args"]  # never the key itself on the command line
    assert all("ADMIN" not in e["name"] for e in c["env"])
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "admin-key"]
    assert mount["readOnly"] is True
    (volume,) = [v for v in spec["volumes"] if v["name"] == "admin-key"]
    (item,) = volume["secret"]["items"]
    assert volume["secret"]["secretName"] == "ps-admin" and item["key"] == "token"
    assert key_file == f"{mount['mountPath']}/{item['path']}"
    assert volume["secret"]["defaultMode"] & 0o040  # group read: the fsGroup the server runs with
    assert spec["securityContext"]["fsGroup"] == c["securityContext"]["runAsGroup"]
    assert parse_settings(["serve", *c["args"]])[1].admin_key_file == Path(key_file)


@pytest.mark.parametrize(
    ("weights", "where"),
    [
        pytest.param({"enabled": True, "source": {"type": "pvc"}}, "/weights/source", id="pvc-without-claim"),
        pytest.param({"enabled": True, "source": {"type": "hostPath", "hostPath": {"path": "ckpt"}}},
                     "/weights/source/hostPath/path", id="hostPath-relative"),
        pytest.param({"enabled": True, "source": {"type": "nfs", "nfs": {"server": "", "path": "/x"}}},
                     "/weights/source/nfs/server", id="nfs-without-server"),
        pytest.param({"enabled": True, "source": {"type": "none"}}, "/weights/source/type", id="no-volume"),
        pytest.param({"enabled": True, "mountPath": "weights"}, "/weights/mountPath", id="relative-mount"),
        pytest.param({"adminKey": {"secretName": "k", "secretKey": ""}}, "/weights/adminKey/secretKey",
                     id="empty-secret-key"),
        pytest.param({"root": "/weights"}, "additional properties 'root'", id="typo"),
        pytest.param({"recordClaim": True}, "/weights/recordClaim", id="record-claim-not-a-name"),
    ],
)
def test_incomplete_weights_values_are_rejected_by_the_schema(weights, where):
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart({"weights": weights})
    assert where in str(err.value)


@pytest.mark.parametrize("mount_path", ["/models", "/cache", "/tmp", "/run/secrets/packscore-admin",
                                        "/var/lib/packscore"])
def test_weights_mount_path_must_be_its_own(mount_path):
    values = {"model": {"path": "/models/x", "mountPath": "/models",
                        "source": {"type": "pvc", "pvc": {"claimName": "models"}}},
              "weights": {"enabled": True, "mountPath": mount_path, "adminKey": {"secretName": "ps-admin"},
                          "source": {"type": "hostPath", "hostPath": {"path": "/mnt/ckpt"}}}}
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert f"weights.mountPath({mount_path}) is already a mount of the pod" in str(err.value)


@pytest.mark.parametrize(("mount_path", "held"), [("/", "/dev/shm"), ("/var/", "/var/lib/packscore"),
                                                  ("/run", "/run/secrets/packscore-admin")])
def test_weights_mount_path_may_not_hold_a_mount_of_the_pod(mount_path, held):
    """As with the model volume: the inner mount point cannot be made in the read-only checkpoint volume."""
    values = {"weights": {"enabled": True, "mountPath": mount_path, "adminKey": {"secretName": "ps-admin"},
                          "source": {"type": "hostPath", "hostPath": {"path": "/mnt/ckpt"}}}}
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    message = str(err.value)
    assert f"weights.mountPath({mount_path}) holds {held}, a mount of the pod" in message, message
    assert "give the checkpoints a path outside the pod's mounts" in message, message
    values["weights"]["mountPath"] = "/run/secrets/packscore"  # a sibling sharing the prefix only
    assert render_chart(values)


# A path at or around a volume weight updates add only on request: the record's (weights.record) or the admin key's.
UNMOUNTED = [
    pytest.param("/var/lib", {"record": False}, {"record": True}, id="around-the-record-off"),
    pytest.param("/var/lib/packscore", {"record": False}, {"record": True}, id="at-the-record-off"),
    pytest.param("/run", {}, {"adminKey": {"secretName": "ps-admin"}}, id="around-no-admin-key"),
    pytest.param("/run/secrets/packscore-admin", {}, {"adminKey": {"secretName": "ps-admin"}}, id="at-no-admin-key"),
]


def own_mounts_at_or_under(values: dict, name: str) -> list[str]:
    """The pod's mount paths, other than volume `name`'s, at or below the one volume `name` has."""
    mounts = {m["name"]: m["mountPath"].rstrip("/") for m in container(values)["volumeMounts"]}
    top = mounts.pop(name)
    return [p for p in mounts.values() if p == top or p.startswith(top + "/")]


@pytest.mark.parametrize(("mount_path", "off", "on"), UNMOUNTED)
def test_model_mount_path_may_take_a_path_of_a_volume_the_pod_leaves_out(mount_path, off, on):
    """Only the pod's actual mounts are refused: with that volume left out, nothing is mounted there."""
    values = {"model": {"path": "/x/m", "mountPath": mount_path, "source": {"type": "pvc", "pvc": {"claimName": "m"}}},
              "weights": {"enabled": True, "source": {"type": "hostPath", "hostPath": {"path": "/mnt/ckpt"}}, **off}}
    assert own_mounts_at_or_under(values, "model") == []
    values["weights"].update(on)  # that volume mounted: the refusal stands
    with pytest.raises(helm.HelmError, match=r"model\.mountPath\(.*(is already a mount of|holds .*a mount of) the pod"):
        render_chart(values)


@pytest.mark.parametrize(("mount_path", "off", "on"), UNMOUNTED)
def test_weights_mount_path_may_take_a_path_of_a_volume_the_pod_leaves_out(mount_path, off, on):
    values = {"weights": {"enabled": True, "mountPath": mount_path,
                          "source": {"type": "hostPath", "hostPath": {"path": "/mnt/ckpt"}}, **off}}
    assert own_mounts_at_or_under(values, "weights") == []
    assert arg_value(container(values)["args"], "--weights-root") == mount_path
    values["weights"].update(on)
    with pytest.raises(helm.HelmError, match=r"weights\.mountPath\(.*(is already a mount of|holds .*a mount of) the pod"):
        render_chart(values)


@pytest.mark.parametrize(("model_path", "weights_path"), [("/models", "/models/ckpt"), ("/ckpt/base/", "/ckpt"),
                                                         ("/data/models", "/data/models/run-42/")])
def test_weights_and_model_mount_paths_may_not_nest(model_path, weights_path):
    """Kubernetes takes it, but the inner mount point cannot be made in the outer read-only volume (runc: read-only
    file system, the container never starts), and where it exists the inner volume hides the outer one's directory."""
    values = {"model": {"path": "/x/m", "mountPath": model_path, "source": {"type": "pvc", "pvc": {"claimName": "m"}}},
              "weights": {"enabled": True, "mountPath": weights_path,
                          "source": {"type": "hostPath", "hostPath": {"path": "/mnt/ckpt"}}}}
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    message = str(err.value)
    assert f"weights.mountPath({weights_path}) and model.mountPath({model_path}) lie one inside the other" in message
    assert "give each a path outside the other" in message, message
    values["weights"]["mountPath"] = model_path.rstrip("/") + "2"  # a sibling sharing the prefix only
    mounts = {m["name"]: m["mountPath"] for m in container(values)["volumeMounts"]}
    assert (mounts["model"], mounts["weights"]) == (model_path, model_path.rstrip("/") + "2")
    values["model"]["source"] = {"type": "none"}  # no model volume: nothing mounted there
    values["weights"]["mountPath"] = weights_path
    assert render_chart(values)


def test_weight_updates_are_recorded_on_an_empty_dir_so_a_restarted_container_keeps_them(monkeypatch):
    weights = {"enabled": True, "mountPath": "/ckpt", "source": WEIGHT_SOURCES[0].values[0]}
    spec = pod_spec({"weights": weights})
    (c,) = spec["containers"]
    (env,) = [e for e in c["env"] if e["name"] == "PACKSCORE_WEIGHTS_RECORD"]
    record = Path(env["value"])
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "weights-record"]
    assert mount == {"name": "weights-record", "mountPath": str(record.parent)}  # writable: the root filesystem is not
    (volume,) = [v for v in spec["volumes"] if v["name"] == "weights-record"]
    assert set(volume) == {"name", "emptyDir"}  # outlives a container restart, not the pod
    monkeypatch.setenv("PACKSCORE_WEIGHTS_RECORD", env["value"])
    settings = parse_settings(["serve", *c["args"]])[1]
    assert settings.weights_record == record and settings.weights_root == Path("/ckpt")
    assert "A restarted container serves the last update again" in render_chart({"weights": weights})[
        "packscore/templates/NOTES.txt"]

    off = pod_spec({"weights": {**weights, "record": False}})
    assert "weights-record" not in {v["name"] for v in off["volumes"]}
    assert "PACKSCORE_WEIGHTS_RECORD" not in {e["name"] for e in off["containers"][0]["env"]}
    assert "PACKSCORE_WEIGHTS_RECORD" not in {e["name"] for e in container()["env"]}  # no updates, nothing to record


def test_weight_updates_recorded_on_a_shared_claim_reach_every_new_pod_of_the_release(monkeypatch):
    """weights.recordClaim: the record on an existing ReadWriteMany claim, the same file for every
    pod (no subPath of the pod's own), writable; record false beside a claim is refused."""
    weights = {"enabled": True, "mountPath": "/ckpt", "source": WEIGHT_SOURCES[0].values[0],
               "recordClaim": "packscore-record"}
    spec = pod_spec({"weights": weights})
    (c,) = spec["containers"]
    (env,) = [e for e in c["env"] if e["name"] == "PACKSCORE_WEIGHTS_RECORD"]
    record = Path(env["value"])
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "weights-record"]
    assert mount == {"name": "weights-record", "mountPath": str(record.parent)}
    (volume,) = [v for v in spec["volumes"] if v["name"] == "weights-record"]
    assert volume == {"name": "weights-record", "persistentVolumeClaim": {"claimName": "packscore-record"}}
    monkeypatch.setenv("PACKSCORE_WEIGHTS_RECORD", env["value"])
    assert parse_settings(["serve", *c["args"]])[1].weights_record == record
    rendered = render_chart({"weights": weights, "prometheusRule": {"enabled": True}})
    notes = rendered["packscore/templates/NOTES.txt"]
    assert "claim packscore-record" in notes and "a new pod serves the last update any pod recorded" in notes, notes
    # deleting the pod alone restores nothing: its successor reads the same record
    alerts = rendered["packscore/templates/prometheusrule.yaml"]
    assert "delete weights-record.json on claim packscore-record (every new pod reads it), then the pod" in alerts

    with pytest.raises(helm.HelmError) as err:
        render_chart({"weights": {**weights, "record": False}})
    assert "weights.recordClaim(packscore-record) holds the record, which weights.record false turns off" in str(err.value)
    off = pod_spec({"weights": {**weights, "enabled": False}})  # no updates: nothing recorded, no claim mounted
    assert "weights-record" not in {v["name"] for v in off["volumes"]}
