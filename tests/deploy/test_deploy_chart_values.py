"""The Helm chart turns values into the objects its README promises (rendered by Helm itself); weight
updates' values in test_deploy_chart_weights.py."""

from __future__ import annotations

import json
import math
import re
import typing

import helm_python as helm
import pytest
import yaml

from deploy_helpers import (
    CHART, CLI_OPTIONS, NAMESPACE, RELEASE, REPO, VALUE_SETS, arg_value, by_kind, container, manifests, one, pod_spec,
    render_chart,
)
from model_runtime.parallel.dims import ParallelDims
from service.cli import parse_settings
from service.http.server import _EXIT_GRACE_S
from service.readiness import _READY_WAIT_S
from service.scheduling.admission import Admission
from service.scheduling.scheduler import _FLOOR_ROWS
from service.settings import Settings

FULLNAME = f"{RELEASE}-packscore"
# Weight updates with every volume they may add: the record's (/var/lib/packscore) and the admin key's.
WEIGHTS_WITH_ADMIN_KEY = {"enabled": True, "source": {"type": "pvc", "pvc": {"claimName": "ckpt"}},
                          "adminKey": {"secretName": "ps-admin"}}


def test_defaults_render_the_core_objects_only():
    kinds = sorted(d["kind"] for d in manifests())
    assert kinds == ["Deployment", "PodDisruptionBudget", "Service", "ServiceAccount"]
    for d in manifests():
        assert d["metadata"]["name"] == FULLNAME
        assert d["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_gpus_become_resource_requests_limits_and_world_size(gpus):
    c = container({"gpus": gpus})
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert c["resources"]["requests"]["nvidia.com/gpu"] == gpus
    assert arg_value(c["args"], "--world-size") == str(gpus)  # worldSize 0: one worker per GPU


@pytest.mark.parametrize("part", ["requests", "limits"])
def test_gpu_resource_comes_only_from_gpus(part):
    """A second nvidia.com/gpu key in one mapping: Helm keeps the chart's, dropping this one without a word, and
    Flux or kustomize post-renderers refuse the duplicate ("mapping key already defined")."""
    values = {"resources": {part: {"nvidia.com/gpu": 4}}}
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert f"resources.{part}[nvidia.com/gpu] is set by the chart from gpus(8)" in str(err.value)
    values["resources"][part] = {"cpu": "8"}  # other resources still pass through
    assert container(values)["resources"][part]["cpu"] == "8"


def test_default_layout_is_one_worker_per_gpu_on_eight_gpus():
    c = container()
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert arg_value(c["args"], "--world-size") == "8"
    assert arg_value(c["args"], "--sp") == "1"
    assert "--fsdp" not in c["args"]


def test_parallel_layout_reaches_the_command_line():
    args = container({"parallel": {"worldSize": 8, "sp": 4, "fsdp": True}})["args"]
    assert arg_value(args, "--world-size") == "8"
    assert arg_value(args, "--sp") == "4"
    assert "--fsdp" in args


@pytest.mark.parametrize(
    ("values", "message"),
    [
        pytest.param({"parallel": {"worldSize": 8, "sp": 3, "fsdp": False}},
                     "parallel.worldSize(8) % parallel.sp(3) = 2, must be 0", id="sp-does-not-divide"),
        pytest.param({"gpus": 4, "parallel": {"worldSize": 8, "sp": 1, "fsdp": False}},
                     "parallel.worldSize(8) > gpus(4)", id="more-workers-than-gpus"),
        pytest.param({"gpus": 6, "parallel": {"worldSize": 0, "sp": 4, "fsdp": False}},
                     "parallel.worldSize(6) % parallel.sp(4) = 2, must be 0", id="default-world-size-checked"),
    ],
)
def test_impossible_layouts_fail_with_the_arithmetic(values, message):
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert message in str(err.value)


def test_server_options_become_flags_and_large_numbers_stay_integers():
    args = container({"server": {
        "maxBatchTokens": 65536, "maxWaitMs": 0, "maxQueuedTokens": 4_000_000,
        "maxRequestBytes": 268_435_456, "maxModelLen": 262_144, "dtype": "bfloat16",
        "allowSlowKernels": True, "kernels": "attention=varlen", "extraArgs": ["--device", "cuda"],
    }})["args"]
    assert arg_value(args, "--kernels") == "attention=varlen"
    assert arg_value(args, "--max-batch-tokens") == "65536"
    assert arg_value(args, "--max-wait-ms") == "0"
    assert arg_value(args, "--max-queued-tokens") == "4000000"  # not 4e+06
    assert arg_value(args, "--max-request-bytes") == "268435456"
    assert arg_value(args, "--max-model-len") == "262144"
    assert arg_value(args, "--dtype") == "bfloat16"
    assert "--allow-slow-kernels" in args
    assert args[-2:] == ["--device", "cuda"]


def test_fractional_max_wait_ms_is_kept():
    assert arg_value(container({"server": {"port": 8000, "drainTimeoutS": 60, "maxWaitMs": 2.5}})["args"],
                     "--max-wait-ms") == "2.5"


def test_hpa_target_must_stay_below_the_admission_bound():
    values = {"server": {"port": 8000, "drainTimeoutS": 60, "maxQueuedTokens": 100_000},
              "autoscaling": {"enabled": True, "targetQueuedTokens": 100_000}}
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert "autoscaling.targetQueuedTokens(100000) >= server.maxQueuedTokens(100000)" in str(err.value)
    values["autoscaling"]["targetQueuedTokens"] = 50_000
    assert one(manifests(values), "HorizontalPodAutoscaler")
    values["autoscaling"]["targetQueuedTokens"] = None  # the default: one row per GPU, 131072 on 8 GPUs
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert "autoscaling.targetQueuedTokens(131072) >= server.maxQueuedTokens(100000)" in str(err.value)


@pytest.mark.parametrize(("values", "target"), [
    ({}, 131072), ({"gpus": 1}, 16384), ({"gpus": 2, "server": {"maxBatchTokens": 65536}}, 131072),
    ({"gpus": 4, "parallel": {"sp": 4}}, 65536), ({"gpus": 8, "parallel": {"sp": 2, "fsdp": True}}, 131072),
])
def test_default_hpa_target_is_reached_under_overload_whatever_the_models_speed(values, target):
    """packscore_queued_tokens never passes the admission bound (a request beyond it waits, then 429): a target
    above it is never reached. A slow model's bound is its floor, 3 rows per GPU (49152 on 1 GPU)."""
    values = {**values, "autoscaling": {"enabled": True}}
    hpa = one(manifests(values), "HorizontalPodAutoscaler")
    rendered = int(hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"])
    _, s = parse_settings(["serve", *container(values)["args"]])
    dims = ParallelDims.from_world(s.world_size, s.sp, s.fsdp)
    row = dims.row_token_budget(s.max_batch_tokens)
    admission = Admission(gpus=dims.dp, row_tokens=row, queue_seconds=s.queue_seconds, floor_rows=_FLOOR_ROWS,
                          max_tokens=s.queued_tokens, max_wait_s=s.max_admission_wait_s)
    admission.observe(row, row / 2000.0)  # 2,000 tokens/s per GPU: FSDP of a large model on a small card
    assert admission.bound == _FLOOR_ROWS * row * dims.dp
    assert rendered <= admission.bound / _FLOOR_ROWS  # one row per GPU: a third of the floor
    assert rendered == target


def test_hpa_min_replicas_may_not_exceed_max_replicas():
    """The API server refuses such an HPA at install, after the render passed."""
    values = {"autoscaling": {"enabled": True, "minReplicas": 6, "maxReplicas": 4}}
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert "autoscaling.minReplicas(6) > autoscaling.maxReplicas(4)" in str(err.value)
    values["autoscaling"]["maxReplicas"] = 6
    assert one(manifests(values), "HorizontalPodAutoscaler")["spec"]["minReplicas"] == 6
    assert one(manifests({"autoscaling": {"enabled": False, "minReplicas": 6, "maxReplicas": 4}}), "Deployment")


def test_unset_server_options_are_left_to_the_server():
    args = container()["args"]
    for flag in ["--max-batch-tokens", "--max-wait-ms", "--max-queued-tokens", "--max-request-bytes",
                 "--max-model-len", "--dtype", "--allow-slow-kernels", "--kernels"]:
        assert flag not in args


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_flag_is_a_documented_packscore_serve_option(name):
    args = container(VALUE_SETS[name])["args"]
    flags = {a for a in args if a.startswith("--")}
    assert flags <= CLI_OPTIONS, flags - CLI_OPTIONS
    assert "command" not in container(VALUE_SETS[name])  # the image's ENTRYPOINT: packscore serve
    assert arg_value(args, "--host") == "0.0.0.0"


def test_api_key_comes_from_the_secret_into_packscore_api_key():
    c = container({"apiKey": {"secretName": "ps-key", "secretKey": "token"}})
    (env,) = [e for e in c["env"] if e["name"] == "PACKSCORE_API_KEY"]
    assert env == {"name": "PACKSCORE_API_KEY",
                   "valueFrom": {"secretKeyRef": {"name": "ps-key", "key": "token"}}}
    assert "--api-key" not in c["args"]  # never on the command line, where `ps` shows it


def test_no_api_key_without_a_secret():
    c = container()
    assert all(e["name"] != "PACKSCORE_API_KEY" for e in c["env"])
    rendered = "".join(render_chart().values())
    assert "secretKeyRef" not in rendered
    assert "kind: Secret\n" not in rendered  # the chart never creates the key itself


def test_probes_hit_the_documented_paths():
    c = container()
    port = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert port == {"http": 8000}
    for probe, path in [("startupProbe", "/readyz"), ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")]:
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe


def test_startup_probe_allows_thirty_minutes_to_load_a_checkpoint():
    p = container()["startupProbe"]
    assert p["periodSeconds"] * p["failureThreshold"] >= 30 * 60
    # Liveness only starts once startup passed; it must not kill a slow but live pod sooner.
    live = container()["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] >= 60


@pytest.mark.parametrize("probe", ["startup", "readiness"])
def test_readyz_probes_outwait_the_scoring_pass_readyz_may_wait_for(probe):
    # Kubernetes' default timeout (1 s) would fail a busy pod's /readyz, which waits up to _READY_WAIT_S.
    shortest = math.floor(_READY_WAIT_S) + 1
    probes = {probe: {"path": "/readyz", "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": shortest - 1}}
    with pytest.raises(helm.HelmError) as err:
        render_chart({"probes": probes})
    assert f"probes.{probe}.timeoutSeconds({shortest - 1}) <= {shortest - 1}: /readyz may take" in str(err.value)
    probes[probe]["timeoutSeconds"] = shortest
    assert container({"probes": probes})[f"{probe}Probe"]["timeoutSeconds"] == shortest
    probes[probe].update(path="/healthz", timeoutSeconds=1)  # /healthz answers at once
    assert container({"probes": probes})[f"{probe}Probe"]["timeoutSeconds"] == 1


@pytest.mark.parametrize(("drain", "pre_stop", "margin"), [(60, 0, 30), (300, 5, 30), (0, 0, 5)])
def test_termination_grace_outlasts_the_drain(drain, pre_stop, margin):
    values = {"server": {"drainTimeoutS": drain}, "preStopSleepS": pre_stop, "terminationGraceMarginS": margin}
    spec = pod_spec(values)
    (c,) = spec["containers"]
    assert arg_value(c["args"], "--drain-timeout-s") == str(drain)
    assert spec["terminationGracePeriodSeconds"] == pre_stop + drain + margin
    assert spec["terminationGracePeriodSeconds"] > pre_stop + drain
    if pre_stop:
        assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", str(pre_stop)]
    else:
        assert "lifecycle" not in c


def test_default_pre_stop_sleep_lets_endpoints_drop_before_the_drain_starts():
    # SIGTERM at once would answer 503 to requests still routed to the pod until its endpoints are removed.
    spec = pod_spec()
    (c,) = spec["containers"]
    assert c["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    drain = int(arg_value(c["args"], "--drain-timeout-s"))
    assert spec["terminationGracePeriodSeconds"] == 5 + drain + 30


@pytest.mark.parametrize("margin", [1, math.ceil(_EXIT_GRACE_S), math.ceil(_EXIT_GRACE_S) + 1])
def test_termination_grace_margin_outlasts_the_servers_own_exit_timer(margin):
    # A drain that times out ends with the server's exit 0 up to _EXIT_GRACE_S later, plus the exit itself;
    # a margin within that lets Kubernetes SIGKILL the pod first (137, not the contract's clean exit).
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart({"terminationGraceMarginS": margin})
    assert "/terminationGraceMarginS" in str(err.value)


def test_dev_shm_is_a_size_limited_memory_emptydir():
    spec = pod_spec({"shm": {"sizeLimit": "32Gi"}})
    (c,) = spec["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}


def test_security_context_is_locked_down():
    spec = pod_spec()
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] == 1000
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    assert pod["fsGroupChangePolicy"] == "OnRootMismatch"  # no recursive chown of a model claim
    sc = spec["containers"][0]["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["runAsNonRoot"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False


@pytest.mark.parametrize("port", [80, 1023])
def test_a_port_below_1024_needs_the_pods_unprivileged_port_start_lowered(port):
    """Non-root with every capability dropped: below net.ipv4.ip_unprivileged_port_start (1024 unless the runtime or
    the pod lowers it) bind() fails with EACCES at start, on some nodes only (containerd 2 lowers it, CRI-O does not)."""
    c = container()
    assert c["securityContext"]["runAsUser"] == 1000 and c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    with pytest.raises(helm.HelmError) as err:
        render_chart({"server": {"port": port}})
    message = str(err.value)
    assert f"server.port({port}) < net.ipv4.ip_unprivileged_port_start(1024): the server runs as a non-root" in message
    assert f"keep server.port at 1024 or above and give clients port {port} through service.port" in message, message
    assert container({"server": {"port": 1024}})["ports"][0]["containerPort"] == 1024
    sysctl = {"name": "net.ipv4.ip_unprivileged_port_start", "value": str(port)}  # a safe sysctl: any node honours it
    pod = {"sysctls": [sysctl]}  # Helm merges it into the default podSecurityContext
    spec = pod_spec({"server": {"port": port}, "podSecurityContext": pod})
    assert spec["securityContext"]["sysctls"] == [sysctl] and spec["securityContext"]["runAsUser"] == 1000
    assert spec["containers"][0]["ports"][0]["containerPort"] == port
    sysctl["value"] = str(port + 1)
    with pytest.raises(helm.HelmError, match=rf"server.port\({port}\) < net.ipv4.ip_unprivileged_port_start\({port + 1}\)"):
        render_chart({"server": {"port": port}, "podSecurityContext": pod})


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_path_the_server_writes_is_on_a_writable_volume(name):
    spec = pod_spec(VALUE_SETS[name])
    (c,) = spec["containers"]
    writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
    env = {e["name"]: e.get("value") for e in c["env"]}
    paths = [env[k] for k in ["HOME", "TRITON_HOME", "TRITON_CACHE_DIR", "XDG_CACHE_HOME", "TMPDIR"]]
    paths.append(arg_value(c["args"], "--triton-cache-dir"))
    for path in paths:
        assert any(path == m or path.startswith(m.rstrip("/") + "/") for m in writable), (path, writable)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in ["/tmp", "/cache"]:
        (m,) = [m for m in c["volumeMounts"] if m["mountPath"] == mount]
        assert "emptyDir" in volumes[m["name"]] or "persistentVolumeClaim" in volumes[m["name"]]


def test_home_moves_off_the_images_home_on_the_read_only_root_filesystem():
    # torch, Triton, huggingface_hub, matplotlib, pip and CUDA's JIT cache fall back to $HOME (~/.cache, ~/.config, ~/.nv)
    (image_home,) = re.findall(r"\bENV HOME=(\S+)", (REPO / "Dockerfile").read_text())
    c = container()
    writable = [m["mountPath"] for m in c["volumeMounts"] if not m.get("readOnly")]
    assert not any(image_home == m or image_home.startswith(m + "/") for m in writable), (image_home, writable)
    assert {"name": "HOME", "value": "/cache"} in c["env"]


def test_triton_cache_can_live_on_an_existing_claim():
    spec = pod_spec({"cache": {"sizeLimit": "8Gi", "existingClaim": "triton-cache"}})
    (vol,) = [v for v in spec["volumes"] if v["name"] == "cache"]
    assert vol == {"name": "cache", "persistentVolumeClaim": {"claimName": "triton-cache"}}


MODEL_SOURCES = [
    pytest.param({"type": "none"}, None, id="none-preset"),
    pytest.param({"type": "pvc", "pvc": {"claimName": "models"}},
                 {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}}, id="pvc"),
    pytest.param({"type": "hostPath", "hostPath": {"path": "/mnt/models", "type": "Directory"}},
                 {"hostPath": {"path": "/mnt/models", "type": "Directory"}}, id="hostPath"),
    pytest.param({"type": "nfs", "nfs": {"server": "10.0.0.5", "path": "/export/models"}},
                 {"nfs": {"server": "10.0.0.5", "path": "/export/models", "readOnly": True}}, id="nfs"),
]


@pytest.mark.parametrize(("source", "volume_source"), MODEL_SOURCES)
def test_model_volume_variants_are_mounted_read_only(source, volume_source):
    path = "tiny" if source["type"] == "none" else "/models/Qwen3.5-9B"
    spec = pod_spec({"model": {"path": path, "mountPath": "/models", "source": source}})
    (c,) = spec["containers"]
    assert arg_value(c["args"], "--model") == path
    model_mounts = [m for m in c["volumeMounts"] if m["name"] == "model"]
    model_volumes = [v for v in spec["volumes"] if v["name"] == "model"]
    if volume_source is None:
        assert model_mounts == [] and model_volumes == []
        return
    (mount,) = model_mounts
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    (volume,) = model_volumes
    assert volume == {"name": "model", **volume_source}


def test_pvc_sub_path_is_mounted():
    spec = pod_spec({"model": {"path": "/models/Qwen3.5-27B", "mountPath": "/models",
                               "source": {"type": "pvc", "pvc": {"claimName": "models", "subPath": "qwen"}}}})
    (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "model"]
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True, "subPath": "qwen"}


@pytest.mark.parametrize(("mount_path", "weights"), [("/cache", False), ("/tmp/", False), ("/dev/shm", False),
                                                     ("/var/lib/packscore", True), ("/run/secrets/packscore-admin", True)])
def test_model_mount_path_must_be_its_own(mount_path, weights):
    """Two volumes at one path: the API server would refuse the pod template, after the render passed."""
    values = {"model": {"path": "/x/m", "mountPath": mount_path, "source": {"type": "pvc", "pvc": {"claimName": "m"}}}}
    if weights:
        values["weights"] = WEIGHTS_WITH_ADMIN_KEY
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    assert f"model.mountPath({mount_path}) is already a mount of the pod" in str(err.value)
    values["model"]["source"] = {"type": "none"}  # no model volume: nothing mounted there
    assert render_chart(values)


@pytest.mark.parametrize(("mount_path", "weights", "held"), [("/", False, "/dev/shm"), ("/dev/", False, "/dev/shm"),
                                                             ("/var", True, "/var/lib/packscore"),
                                                             ("/run/secrets", True, "/run/secrets/packscore-admin")])
def test_model_mount_path_may_not_hold_a_mount_of_the_pod(mount_path, weights, held):
    """Kubernetes takes it, but the inner mount point cannot be made in the read-only model volume (runc: read-only
    file system, the container never starts), and where it exists the inner mount hides the model's directory."""
    values = {"model": {"path": "/x/m", "mountPath": mount_path, "source": {"type": "pvc", "pvc": {"claimName": "m"}}}}
    if weights:
        values["weights"] = WEIGHTS_WITH_ADMIN_KEY
    with pytest.raises(helm.HelmError) as err:
        render_chart(values)
    message = str(err.value)
    assert f"model.mountPath({mount_path}) holds {held}, a mount of the pod" in message, message
    assert "give the model volume a path outside the pod's mounts" in message, message
    values["model"]["source"] = {"type": "none"}  # no model volume: nothing mounted there
    assert render_chart(values)
    values["model"] = {"path": "/x/m", "mountPath": "/var/lib/packscore-models",  # a sibling sharing the prefix only
                       "source": {"type": "pvc", "pvc": {"claimName": "m"}}}
    assert render_chart(values)


@pytest.mark.parametrize(
    ("source", "where"),
    [
        pytest.param({"type": "pvc"}, "/model/source", id="pvc-without-claim"),
        pytest.param({"type": "pvc", "pvc": {"claimName": ""}}, "/model/source/pvc/claimName", id="pvc-empty-claim"),
        pytest.param({"type": "hostPath", "hostPath": {"path": "relative"}}, "/model/source/hostPath/path",
                     id="hostPath-relative"),
        pytest.param({"type": "nfs", "nfs": {"server": "", "path": "/x"}}, "/model/source/nfs/server",
                     id="nfs-without-server"),
        pytest.param({"type": "s3"}, "/model/source/type", id="unknown-type"),
    ],
)
def test_incomplete_model_sources_are_rejected_by_the_schema(source, where):
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart({"model": {"path": "/models/x", "mountPath": "/models", "source": source}})
    assert where in str(err.value)


@pytest.mark.parametrize(
    ("values", "where"),
    [
        pytest.param({"gpus": 0}, "/gpus", id="zero-gpus"),
        pytest.param({"gpu": 8}, "additional properties 'gpu'", id="typo-top-level"),
        pytest.param({"server": {"port": 8000, "drainTimeoutS": 60, "drainTimeout": 5}},
                     "additional properties 'drainTimeout'", id="typo-nested"),
        pytest.param({"parallel": {"worldSize": 8, "sp": 0, "fsdp": False}}, "/parallel/sp", id="sp-zero"),
        pytest.param({"shm": {"sizeLimit": "lots"}}, "/shm/sizeLimit", id="bad-quantity"),
        pytest.param({"server": {"port": 8000, "drainTimeoutS": 60, "dtype": "bf16"}}, "/server/dtype",
                     id="dtype-packscore-serve-refuses"),
        pytest.param({"gpuProducts": ["NVIDIA H200"]}, "/gpuProducts/0", id="gpu-product-not-a-label-value"),
        pytest.param({"probes": {"startup": {"path": "readyz", "periodSeconds": 10, "failureThreshold": 1,
                                             "timeoutSeconds": 1}}}, "/probes/startup/path", id="relative-probe-path"),
        # Kubernetes requires 1 on these two: a value the template does not render must not pass silently.
        *(pytest.param({"probes": {probe: {"path": path, "periodSeconds": 10, "failureThreshold": 3, "timeoutSeconds": 5,
                                           "successThreshold": 2}}},
                       f"at '/probes/{probe}': additional properties 'successThreshold'", id=f"{probe}-success-threshold")
          for probe, path in [("startup", "/readyz"), ("liveness", "/healthz")]),
    ],
)
def test_schema_rejects_bad_values(values, where):
    with pytest.raises(helm.HelmValuesError) as err:
        render_chart(values)
    assert where in str(err.value)


def test_schema_dtypes_are_the_ones_packscore_serve_accepts():
    # A dtype the server refuses renders fine but crash-loops the pod: the schema must refuse it first.
    accepted = set(typing.get_args(Settings.model_fields["dtype"].annotation))
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert set(schema["properties"]["server"]["properties"]["dtype"]["enum"]) == accepted | {None}
    for dtype in sorted(accepted):
        assert arg_value(container({"server": {"port": 8000, "drainTimeoutS": 60, "dtype": dtype}})["args"],
                         "--dtype") == dtype


OPTIONAL = [
    pytest.param("serviceMonitor", "ServiceMonitor", False, id="ServiceMonitor"),
    pytest.param("prometheusRule", "PrometheusRule", False, id="PrometheusRule"),
    pytest.param("autoscaling", "HorizontalPodAutoscaler", False, id="HPA"),
    pytest.param("networkPolicy", "NetworkPolicy", False, id="NetworkPolicy"),
    pytest.param("podDisruptionBudget", "PodDisruptionBudget", True, id="PodDisruptionBudget"),
]


@pytest.mark.parametrize(("key", "kind", "default_on"), OPTIONAL)
def test_optional_objects_exist_only_when_enabled(key, kind, default_on):
    assert len(by_kind(manifests(), kind)) == (1 if default_on else 0)
    assert len(by_kind(manifests({key: {"enabled": True}}), kind)) == 1
    assert by_kind(manifests({key: {"enabled": False}}), kind) == []


@pytest.mark.parametrize(("section", "value", "key"), [
    ("podLabels", None, "app.kubernetes.io/component"),
    ("serviceMonitor", "serviceMonitor.labels", "app.kubernetes.io/name"),
    ("prometheusRule", "prometheusRule.labels", "helm.sh/chart"),
])
def test_own_labels_may_not_repeat_the_charts(section, value, key):
    """A repeated key: Helm keeps the user's (a selector label moved: the Deployment refused), Flux or kustomize
    post-renderers refuse the YAML ("mapping key already defined")."""
    def values(labels):
        return {"podLabels": labels} if section == "podLabels" else {section: {"enabled": True, "labels": labels}}
    with pytest.raises(helm.HelmError) as err:
        render_chart(values({key: "x"}))
    assert f"{value or section}({key}) is a label the chart sets itself" in str(err.value)
    (obj,) = [d for d in manifests(values({"team": "rl"})) if d["kind"] in ("Deployment", "ServiceMonitor", "PrometheusRule")
              and (d["kind"] == "Deployment") == (section == "podLabels")]
    labels = obj["spec"]["template"]["metadata"]["labels"] if section == "podLabels" else obj["metadata"]["labels"]
    assert labels["team"] == "rl"


def test_service_account_is_optional():
    assert one(manifests(), "ServiceAccount")["automountServiceAccountToken"] is False
    docs = manifests({"serviceAccount": {"create": False, "name": "shared"}})
    assert by_kind(docs, "ServiceAccount") == []
    assert one(docs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "shared"


def test_hpa_scales_on_queued_tokens_and_owns_the_replica_count():
    docs = manifests({"replicaCount": 3, "autoscaling": {
        "enabled": True, "minReplicas": 2, "maxReplicas": 5, "targetQueuedTokens": 3_000_000}})
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 5)
    (metric,) = hpa["spec"]["metrics"]
    assert metric == {"type": "Pods", "pods": {"metric": {"name": "packscore_queued_tokens"},
                                               "target": {"type": "AverageValue", "averageValue": "3000000"}}}
    assert "replicas" not in one(docs, "Deployment")["spec"]
    assert one(manifests({"replicaCount": 3}), "Deployment")["spec"]["replicas"] == 3


def test_service_monitor_scrapes_metrics_and_sends_the_api_key():
    sm = one(manifests({"serviceMonitor": {"enabled": True, "labels": {"release": "prom"}}}), "ServiceMonitor")
    (ep,) = sm["spec"]["endpoints"]
    assert (ep["port"], ep["path"]) == ("http", "/metrics")
    assert "authorization" not in ep
    assert sm["metadata"]["labels"]["release"] == "prom"
    svc = one(manifests(), "Service")
    assert sm["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    sm = one(manifests({"serviceMonitor": {"enabled": True},
                        "apiKey": {"secretName": "ps-key", "secretKey": "api-key"}}), "ServiceMonitor")
    (ep,) = sm["spec"]["endpoints"]
    assert ep["authorization"] == {"type": "Bearer", "credentials": {"name": "ps-key", "key": "api-key"}}


def test_network_policy_opens_only_the_http_port():
    peers = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "trainers"}}}]
    np = one(manifests({"networkPolicy": {"enabled": True, "from": peers}}), "NetworkPolicy")
    assert np["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np["spec"]["ingress"]
    assert rule == {"ports": [{"port": "http", "protocol": "TCP"}], "from": peers}
    assert np["spec"]["podSelector"] == {"matchLabels": one(manifests(), "Service")["spec"]["selector"]}


def test_pod_disruption_budget_min_available_replaces_max_unavailable():
    assert one(manifests(), "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    pdb = one(manifests({"podDisruptionBudget": {"enabled": True, "minAvailable": "50%"}}), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == "50%" and "maxUnavailable" not in pdb["spec"]


def test_service_targets_the_container_port():
    svc = one(manifests({"service": {"type": "ClusterIP", "port": 80}}), "Service")
    assert svc["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}]
    dep = one(manifests(), "Deployment")
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()


def test_image_defaults_to_the_chart_app_version():
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert container()["image"] == f"packscore:{chart['appVersion']}"
    assert container({"image": {"repository": "r.example.com/p", "tag": "abc", "pullPolicy": "Always"}})["image"] \
        == "r.example.com/p:abc"


def test_notes_tell_how_to_reach_the_service():
    notes = render_chart({"apiKey": {"secretName": "ps-key", "secretKey": "api-key"}})["packscore/templates/NOTES.txt"]
    assert f"svc/{FULLNAME}" in notes
    assert f"http://{FULLNAME}.{NAMESPACE}.svc:8000/score" in notes
    assert "Authorization: Bearer" in notes
    assert "No API key" in render_chart()["packscore/templates/NOTES.txt"]
    assert "/v1/weights" not in notes  # weight updates are off by default


def test_extra_env_passes_through():
    c = container({"env": [{"name": "NCCL_DEBUG", "value": "WARN"}],
                   "envFrom": [{"secretRef": {"name": "extra"}}]})
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in c["env"]
    assert c["envFrom"] == [{"secretRef": {"name": "extra"}}]
