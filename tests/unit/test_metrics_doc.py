"""docs/deployment.md's metrics table names every family the code defines, with its type, and no
other: read from the registry itself, whether or not a server has written a sample of it yet
(tests/e2e/test_e2e_metrics.py checks the labels on a live server's /metrics)."""

import pytest

from service.http.metrics import Metrics
from tests.live_metrics import documented

_SUFFIX = {"counter": "_total", "info": "_info"}  # prometheus_client names these families without it


def test_every_family_the_registry_defines_is_in_the_table_with_its_type():
    defined = {family.name + _SUFFIX.get(family.type, ""): family.type for family in Metrics().registry.collect()}
    table = documented()
    assert len(defined) > 20, sorted(defined)  # the registry holds the process's series too
    undocumented = sorted(set(defined) - set(table))
    assert not undocumented, f"defined in service/http/metrics.py, not in docs/deployment.md's table: {undocumented}"
    unknown = sorted(set(table) - set(defined))
    assert not unknown, f"in docs/deployment.md's table, defined nowhere: {unknown}"
    wrong = [f"{name}: documented as {table[name].kind}, defined as {kind}" for name, kind in defined.items()
             if table[name].kind != kind]
    assert not wrong, wrong


def test_workers_alive_help_says_what_it_counts_on_any_device():
    """A CPU pool's workers and a one-process backend (its world size) count too, as the table
    says: the HELP an operator reads in Prometheus must not say GPU processes only."""
    (family,) = [f for f in Metrics().registry.collect() if f.name == "packscore_workers_alive"]
    assert "GPU" not in family.documentation, family.documentation
    assert "summed over the models" in family.documentation, family.documentation
    assert "one-process backend counts its world size" in family.documentation, family.documentation


def test_slow_kernel_fallback_help_says_a_cpus_reference_kernels_read_0():
    """A model on the CPU runs reference kernels and reads 0 (they are no fallback): the HELP
    must not say 1 whenever a reference implementation runs."""
    (family,) = [f for f in Metrics().registry.collect() if f.name == "packscore_slow_kernel_fallback"]
    assert "on a GPU fell back" in family.documentation, family.documentation
    assert "--allow-slow-kernels" in family.documentation, family.documentation


@pytest.mark.parametrize("name, says", [
    ("packscore_requests", "499"),  # counted though no answer reached the client
    ("packscore_rejections", "packscore_connections_closed_total"),  # the protocol layer's own answers are not here
    ("packscore_queue_wait_seconds", "readiness pass"),  # its sequence is observed too, as in the forward series
])
def test_help_says_what_the_table_says_a_series_counts_beyond_its_name(name, says):
    """The HELP Prometheus shows names what docs/deployment.md's table says the series counts
    beyond what its name suggests, so an operator reading one does not read it otherwise."""
    (family,) = [f for f in Metrics().registry.collect() if f.name == name]
    assert says in family.documentation, family.documentation
