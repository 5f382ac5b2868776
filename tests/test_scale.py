"""The scale benchmark's reading of what the API server said (bench/scale): its audit log, its
metrics, the kernel's connection table, and the table made of them.

The benchmark itself runs against a real kube-apiserver (`nox -s scale`; CI runs it with
--quick); these check the arithmetic on inputs made here, in the formats the API server and
the kernel write.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
from bench.scale import audit, builds, report  # noqa: E402
from bench.scale.apiserver import go_heap, open_watches  # noqa: E402
from bench.scale.connections import client_sides  # noqa: E402
from bench.scale.run import Figures  # noqa: E402

T0 = 1_800_000_000.0


def stamp(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(T0 + seconds, datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event(
    audit_id: str,
    node: str,
    verb: str,
    resource: str,
    at: float,
    *,
    stage: str = "ResponseComplete",
    code: int = 200,
    took: float = 0.01,
    uri: str = "",
    user_prefix: str = audit.USER_PREFIX,
) -> dict[str, Any]:
    """An audit event as kube-apiserver writes it at level Metadata (audit.k8s.io/v1)."""
    return {
        "kind": "Event",
        "apiVersion": "audit.k8s.io/v1",
        "level": "Metadata",
        "auditID": audit_id,
        "stage": stage,
        "requestURI": uri or f"/apis/resource.k8s.io/v1/{resource}",
        "verb": verb,
        "user": {"username": f"{user_prefix}{node}", "groups": [audit.GROUP]},
        "objectRef": {"resource": resource, "apiGroup": "resource.k8s.io", "apiVersion": "v1"},
        "responseStatus": {"metadata": {}, "code": code},
        "requestReceivedTimestamp": stamp(at),
        "stageTimestamp": stamp(at + took),
    }


def request(node: str, verb: str, at: float, resource: str = audit.SLICES, **kw: Any) -> Any:
    return audit.Request(node, verb, resource, T0 + at, T0 + at + 0.01, **{"code": 200, **kw})


def test_the_log_keeps_one_request_per_audit_id_and_reads_lines_as_they_complete(
    tmp_path: Path,
) -> None:
    path = tmp_path / "audit.log"
    log = audit.AuditLog(path)
    assert log.read() == []  # not written yet
    watch = "/apis/resource.k8s.io/v1/resourceslices?watch=true&resourceVersion=7"
    started = event("w", "node-000", "watch", "resourceslices", 1, stage="ResponseStarted",
                    uri=watch)  # fmt: skip
    dry_run = event("c", "node-000", "create", "resourceslices", 2, code=201,
                    uri="/apis/resource.k8s.io/v1/resourceslices?dryRun=All")  # fmt: skip
    other = event("x", "admin", "list", "nodes", 3, user_prefix="")
    line = json.dumps(started) + "\n" + json.dumps(dry_run) + "\n" + json.dumps(other)
    path.write_text(line[:-10])
    fresh = log.read()
    assert [r.what for r in fresh] == ["WATCH resourceslices", "CREATE resourceslices (dry run)"]
    assert fresh[0].code is None  # still open
    assert not fresh[1].writes_slices()
    with path.open("a") as out:
        out.write(line[-10:] + "\n")
        ended = event("w", "node-000", "watch", "resourceslices", 1, took=300, uri=watch)
        out.write(json.dumps(ended) + "\n")
    fresh = log.read()
    assert len(fresh) == 1  # the admin's list is nobody's
    requests = log.requests()
    assert [(r.what, r.code) for r in requests] == [
        ("WATCH resourceslices", 200),
        ("CREATE resourceslices (dry run)", 201),
    ]
    assert requests[0].answered - requests[0].received == pytest.approx(300, abs=1e-3)


def test_rates_are_per_node_per_hour_by_verb_and_resource() -> None:
    requests = [
        request("node-000", "get", 0, resource="nodes"),
        request("node-000", "list", 0.1),
        request("node-000", "watch", 0.2),
        request("node-001", "watch", 100),
    ]
    rates = audit.per_node_hour(requests, nodes=2, seconds=1800)
    assert rates == {
        "GET nodes": 1.0,
        "LIST resourceslices": 1.0,
        "WATCH resourceslices": 2.0,
        "all": 4.0,
    }
    assert audit.between(requests, T0 + 0.1, T0 + 100) == requests[1:3]


def test_nodes_in_step_are_counted_within_a_span_and_peaks_per_second() -> None:
    # Three nodes within 6 s, then one alone 300 s later.
    requests = [request(f"node-{i:03d}", "list", 2 * i + 0.5) for i in range(4)]
    requests[3] = request("node-003", "list", 300)
    requests += [request("node-000", "watch", 0.6), request("node-000", "get", 0.7)]
    assert audit.most_nodes_within(requests, 10) == 3
    assert audit.most_nodes_within(requests, 1) == 1
    assert audit.peak_per_second(requests) == 3  # node-000's three in second 0
    assert audit.peak_per_second([]) == 0


def test_coming_back_and_writing_again_are_per_node() -> None:
    requests = [
        request("node-000", "get", 5, resource="nodes", code=403),
        request("node-000", "list", 6),
        request("node-000", "create", 7, code=201),
        request("node-001", "create", 3, code=409),
        request("node-001", "create", 20, dry_run=True, code=201),
        request("node-001", "update", 40),
    ]
    first = audit.first_per_node(requests, T0 + 4)
    assert first == {"node-000": T0 + 5, "node-001": T0 + 20}
    assert audit.spread(first.values()) == 15
    written = audit.slices_written(requests, T0)
    assert written == {"node-000": pytest.approx(T0 + 7.01), "node-001": pytest.approx(T0 + 40.01)}
    assert audit.codes(requests) == {"200": 2, "201": 2, "403": 1, "409": 1}
    found = audit.to_first_slice(audit.by_node(requests)["node-000"])
    assert found is not None
    assert [r.what for r in found[0]] == ["GET nodes", "LIST resourceslices",
                                          "CREATE resourceslices"]  # fmt: skip
    assert audit.to_first_slice([requests[3]]) is None


def test_connections_are_the_client_sides_of_the_api_servers_port() -> None:
    # /proc/net/tcp: an established client side (inode 4242), the server's own side of it,
    # a client side in TIME_WAIT (inode 0), and a connection to another port.
    table = """\
  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:9C40 0100007F:D431 01 00000000:00000000 00:00000000 00000000     0        0 4243 1
   1: 0100007F:D431 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 4242 1
   2: 0100007F:D432 0100007F:9C40 06 00000000:00000000 03:00001000 00000000     0        0 0 3
   3: 0100007F:D433 0100007F:0950 01 00000000:00000000 00:00000000 00000000     0        0 99 1
"""
    assert client_sides(table, 0x9C40) == {0xD431: ("01", 4242), 0xD432: ("06", 0)}


def test_open_watches_and_the_heap_are_read_from_the_api_servers_metrics() -> None:
    metrics = """\
# TYPE go_memstats_heap_inuse_bytes gauge
go_memstats_heap_inuse_bytes 1.048576e+08
# TYPE apiserver_longrunning_requests gauge
apiserver_longrunning_requests{component="apiserver",group="resource.k8s.io",resource="resourceslices",scope="cluster",subresource="",verb="WATCH",version="v1"} 100
apiserver_longrunning_requests{component="apiserver",group="",resource="nodes",scope="cluster",subresource="",verb="WATCH",version="v1"} 3
"""  # noqa: E501
    assert open_watches(metrics, "resourceslices") == 100
    assert open_watches(metrics, "resourceclaims") == 0
    assert go_heap(metrics) == 102_400


def figures() -> Figures:
    """What a run measures, as run.py records it."""
    found = Figures()
    change = {"latency": 0.4, "requests": ["GET nodes", "LIST resourceslices"], "cpu": 0.02,
              "within": 90.0}  # fmt: skip
    found.values.update({
        "start.requests": (5, 6), "start.sequence": "GET nodes, LIST resourceslices",
        "start.cpu": (1.0, 1.3), "start.seconds": (2.0, 4.0), "start.spread": 60.0,
        "idle.rates": {"all": 36.0, "LIST resourceslices": 12.0}, "idle.codes": {"200": 60},
        "idle.peak": 12, "idle.at_once": 100, "idle.connections": 12.0,
        "idle.connections_unknown": 0, "idle.established": 1.0, "idle.watches": 100,
        "idle.driver_cpu": 0.0001, "idle.apiserver_cpu": 0.02, "outage.apiserver_start": 9.0,
        "outage.down": 39.0, "outage.first": (0.5, 10.0), "outage.came_back": 100,
        "outage.peak": 50, "outage.herd_requests": 4.0, "outage.connections": 1.0,
        "outage.codes": {"403": 3},
        "outage.consistent": (6.0, 13.0), "outage.never": 0, "outage.later_window": 300.0,
        "outage.later_at_once": 100, "outage.right": 100, "change.gone": change,
        "change.back": change, "change.deleted": change, "memory.driver": (53000, 54000),
        "memory.drivers_total": 5_300_000, "memory.apiserver": 400_000,
        "memory.apiserver_before": 350_000, "memory.etcd": 60_000,
        "memory.apiserver_heap_before": 100_000, "memory.apiserver_heap": 110_240,
    })  # fmt: skip
    return found


def test_the_table_has_a_column_per_kind_and_projects_to_the_fleet() -> None:
    ours, reference = figures(), figures()
    reference.values["idle.rates"] = {"all": 8.0, "WATCH resourceslices": 8.0}
    del reference.values["change.gone"], reference.values["change.back"]
    settings = {"concurrency": 4.0, "settle": 30.0, "idle": 660.0, "outage": 30.0}
    text = report.render(["header"], {"pcc": "ours", "go": "Go"},
                         {"pcc": ours, "go": reference}, 100, settings)  # fmt: skip
    lines = text.splitlines()
    assert lines[0] == "header"
    assert [c.strip() for c in lines[2].split("|")[1:4]] == ["per node unless said", "ours", "Go"]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:4]]
            for line in lines[4:] if line.startswith("|")}  # fmt: skip
    assert rows["requests per node per hour, all"] == ["36.0", "8.0"]
    assert rows["LIST resourceslices"] == ["12.0", "0.0"]
    assert rows["WATCH resourceslices"] == ["0.0", "8.0"]
    assert rows["requests per second, idle"] == ["50.0", "11.1"]
    assert rows["peak requests per second after an outage"] == ["2,500", "2,500"]
    assert rows["its device gone"][1] == "n/a: its devices never change"
    assert rows["kube-apiserver, before the drivers and after idle"][0] == (
        "342 MiB, 391 MiB (+0.49 MiB per driver)"
    )
    assert rows["kube-apiserver's Go heap in use, the same"][1] == (
        "98 MiB, 108 MiB (+0.10 MiB per driver)"
    )
    assert lines[-1].startswith("projection: the per-node figures x 5,000")


def test_the_go_reference_is_pinned_by_a_module_of_ours() -> None:
    assert builds.REFERENCE.module == ROOT / "bench" / "scale" / "dra-example-driver"
    assert builds.REFERENCE.version().startswith("v")
    assert builds.REFERENCE.binaries == ["dra-example-kubeletplugin"]
    go_sum = (builds.REFERENCE.module / "go.sum").read_text()
    assert f"sigs.k8s.io/dra-example-driver {builds.REFERENCE.version()} h1:" in go_sum


def test_one_audit_policy_records_the_drivers_given_and_nobody_else() -> None:
    """The benchmark's drivers (a group) and the cluster check's (a service account) are
    recorded alike: the request's metadata, once it is answered."""
    for who, policy in (
        ({"userGroups": [audit.GROUP]}, audit.policy(groups=[audit.GROUP])),
        (
            {"users": ["system:serviceaccount:ns:a"]},
            audit.policy(users=["system:serviceaccount:ns:a"]),
        ),
    ):
        assert yaml.safe_load(policy) == {
            "apiVersion": "audit.k8s.io/v1",
            "kind": "Policy",
            "omitStages": ["RequestReceived"],
            "rules": [{"level": "Metadata", **who}, {"level": "None"}],
        }
