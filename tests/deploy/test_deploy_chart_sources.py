"""model.source and weights.source take and refuse the same read-only volume sources (one table, both places)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest

from deploy_helpers import CHART, render_chart

REQUIREMENTS_REF = {"$ref": "#/definitions/readOnlyVolumeSourceRequirements"}

GOOD_SOURCES = [
    {"type": "pvc", "pvc": {"claimName": "c"}},
    {"type": "pvc", "pvc": {"claimName": "c", "subPath": "run-1"}},
    {"type": "hostPath", "hostPath": {"path": "/mnt/x"}},
    {"type": "hostPath", "hostPath": {"path": "/mnt/x", "type": ""}},
    {"type": "nfs", "nfs": {"server": "10.0.0.5", "path": "/export"}},
]

# (source, where under the place, message, refused even while weights.enabled is false).
# Helm merges values.yaml first, so a key is missing only when set to null.
BAD_SOURCES: list[tuple[dict[str, Any], str, str, bool]] = [
    ({"type": "pvc", "pvc": None}, "/source", "missing property 'pvc'", False),
    ({"type": "pvc", "pvc": {"claimName": None}}, "/source/pvc", "missing property 'claimName'", False),
    ({"type": "pvc", "pvc": {"claimName": ""}}, "/source/pvc/claimName", "minLength: got 0, want 1", False),
    ({"type": "hostPath", "hostPath": None}, "/source", "missing property 'hostPath'", False),
    ({"type": "hostPath", "hostPath": {"path": None}}, "/source/hostPath", "missing property 'path'", False),
    ({"type": "hostPath", "hostPath": {"path": "rel"}}, "/source/hostPath/path", "'rel' does not match pattern '^/'",
     False),
    ({"type": "nfs", "nfs": None}, "/source", "missing property 'nfs'", False),
    ({"type": "nfs", "nfs": {"server": None, "path": "/e"}}, "/source/nfs", "missing property 'server'", False),
    ({"type": "nfs", "nfs": {"server": "", "path": "/e"}}, "/source/nfs/server", "minLength: got 0, want 1", False),
    ({"type": "nfs", "nfs": {"server": "s", "path": None}}, "/source/nfs", "missing property 'path'", False),
    ({"type": "nfs", "nfs": {"server": "s", "path": "e"}}, "/source/nfs/path", "'e' does not match pattern '^/'",
     False),
    ({"type": None}, "/source", "missing property 'type'", True),
    ({"type": "pvc", "pvc": {"claimName": "c"}, "s3": {}}, "/source", "additional properties 's3' not allowed", True),
    ({"type": "pvc", "pvc": {"claimName": "c", "readOnly": False}}, "/source/pvc",
     "additional properties 'readOnly' not allowed", True),
    ({"type": "hostPath", "hostPath": {"path": "/x", "typ": "Directory"}}, "/source/hostPath",
     "additional properties 'typ' not allowed", True),
    ({"type": "nfs", "nfs": {"server": "s", "path": "/e", "readOnly": False}}, "/source/nfs",
     "additional properties 'readOnly' not allowed", True),
    ({"type": "hostPath", "hostPath": {"path": "/x", "type": "File"}}, "/source/hostPath/type",
     "value must be one of 'Directory', ''", True),
    ({"type": "pvc", "pvc": "models"}, "/source/pvc", "got string, want object", True),
]


def _values(place: str, source: Any) -> dict[str, Any]:
    if place == "model":
        return {"model": {"path": "/models/x", "mountPath": "/models", "source": source}}
    return {"weights": {"enabled": place == "weights", "source": source}}


def _refusal(chart: Path, values: dict[str, Any]) -> str | None:
    try:
        render_chart(values, chart=chart)
    except helm.HelmError as e:  # a schema that lets a bad source through can fail in a template instead
        return str(e)
    return None


def source_mismatches(chart: Path = CHART) -> list[str]:
    """Every place/source pair of the tables above that the chart's schema does not treat as promised."""
    found = []
    for place, key in (("model", "model"), ("weights", "weights"), ("weights-disabled", "weights")):
        for source in GOOD_SOURCES:
            if (err := _refusal(chart, _values(place, source))) is not None:
                found.append(f"{place}: {source} refused: {err}")
        for source, where, message, always in BAD_SOURCES:
            err = _refusal(chart, _values(place, source))
            expected = f"at '/{key}{where}': {message}"
            if place == "weights-disabled" and not always:
                if err is not None:
                    found.append(f"{place}: {source} refused though weights are off: {err}")
            elif err is None or expected not in err:
                found.append(f"{place}: {source} not refused with {expected!r}: {err}")
    return found


def test_model_and_weights_sources_accept_and_refuse_the_same_table():
    mismatches = source_mismatches()
    assert mismatches == [], "\n".join(mismatches)


@pytest.mark.parametrize("enabled", [True, False])
def test_type_none_is_for_the_model_preset_only(enabled):
    render_chart({"model": {"path": "tiny", "source": {"type": "none"}}})
    err = _refusal(CHART, {"weights": {"enabled": enabled, "source": {"type": "none"}}})
    assert err is not None and "at '/weights/source/type': value must be one of 'pvc', 'hostPath', 'nfs'" in err


def _drop_nfs_requirement_from_weights(schema: dict[str, Any]) -> None:
    requirements = json.loads(json.dumps(schema["definitions"]["readOnlyVolumeSourceRequirements"]))
    requirements["allOf"] = [r for r in requirements["allOf"] if r["if"]["properties"]["type"]["const"] != "nfs"]
    schema["properties"]["weights"]["then"]["properties"]["source"] = requirements


def _drop_requirements_from_model(schema: dict[str, Any]) -> None:
    source = schema["properties"]["model"]["properties"]["source"]
    assert REQUIREMENTS_REF in source["allOf"]
    source["allOf"].remove(REQUIREMENTS_REF)


def _open_weights_source_to_unknown_keys(schema: dict[str, Any]) -> None:
    shape = json.loads(json.dumps(schema["definitions"]["readOnlyVolumeSource"]))
    source = schema["properties"]["weights"]["properties"]["source"]
    assert source["allOf"][0] == {"$ref": "#/definitions/readOnlyVolumeSource"}
    del shape["additionalProperties"]
    source["allOf"][0] = shape


@pytest.mark.parametrize("drift", [_drop_nfs_requirement_from_weights, _drop_requirements_from_model,
                                   _open_weights_source_to_unknown_keys])
def test_the_table_catches_one_place_drifting(tmp_path, drift):
    """Guards the table check against passing vacuously: one place losing one rule must fail it."""
    broken = tmp_path / "packscore"
    shutil.copytree(CHART, broken)
    schema_path = broken / "values.schema.json"
    schema = json.loads(schema_path.read_text())
    drift(schema)
    schema_path.write_text(json.dumps(schema, indent=2))
    assert source_mismatches(broken) != []
