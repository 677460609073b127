"""The routed-call latency histogram, build and connection info, the connection
state label and the evidence age ratio, read through the exposition parser.

Calls go through a real ``DiscoveryTransport`` whose pool answers after a
chosen delay on trio's virtual clock, so every latency is exact: 98 calls
of 2 ms and 2 of 3 s answer 200, 3 answer 503 after 40 ms. The p99 is then
computed from the parsed buckets exactly as Prometheus's
``histogram_quantile`` does (linear inside the bucket), and checked
against the documented PromQL's answer for these counts. When ``promtool``
is installed (``make servers``), the exposition is also checked by
``promtool check metrics`` and the documented rules by ``promtool check rules``.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families

from nadisc import DiscoveryConfig, DiscoveryTransport, open_discovery
from nadisc._route import CALL_LATENCY_BUCKETS
from nadisc.observability import metrics_app
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import inst
from tests.observability.support import IN_CI, promtool_check

pytestmark = pytest.mark.trio_only

DOCS = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over cumulative (le, count) buckets."""
    buckets = sorted(buckets)
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == math.inf:
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below)
        lower, below = bound, count
    return lower


async def exposition(app: Any) -> str:
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://metrics"
    ) as client:
        response = await client.get("/metrics")
    assert response.status_code == 200
    return response.text


async def test_call_latency_histogram_answers_a_p99_query(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = MemoryProvider(services={"orders": "order-worker"})
    provider.set("order-worker", [inst("w1")])
    config = DiscoveryConfig.model_validate(
        {"enabled": True, "connections": {"primary": {"provider": "host"}}}
    )
    delays = iter([0.002] * 98 + [3.0] * 2 + [0.04] * 3)
    statuses = iter([200] * 100 + [503] * 3)

    async def answer(request: httpx.Request) -> httpx.Response:
        await trio.sleep(next(delays))
        return httpx.Response(next(statuses), text="x")

    async with (
        open_discovery(config, providers={"primary": provider}) as owner,
        DiscoveryTransport(owner, transport=httpx.MockTransport(answer)) as transport,
        httpx.AsyncClient(mounts={"nadisc://": transport}) as http,
    ):
        codes = [(await http.get("nadisc://primary/orders/")).status_code for _ in range(103)]
        assert codes.count(200) == 100 and codes.count(503) == 3
        text = await exposition(metrics_app(owner, transports=[transport]))

    families = {f.name: f for f in text_string_to_metric_families(text)}
    calls = families["nadisc_discovery_call_duration_seconds"]
    assert calls.type == "histogram"
    by: dict[str, list[tuple[float, float]]] = {}
    counts: dict[str, float] = {}
    sums: dict[str, float] = {}
    for sample in calls.samples:
        outcome = sample.labels["outcome"]
        assert sample.labels["connection"] == "primary"
        if sample.name.endswith("_bucket"):
            by.setdefault(outcome, []).append((float(sample.labels["le"]), sample.value))
        elif sample.name.endswith("_count"):
            counts[outcome] = sample.value
        elif sample.name.endswith("_sum"):
            sums[outcome] = sample.value
    assert set(by) == {"ok", "transport", "timeout", "status", "no_endpoint", "other"}
    # Buckets from 1 ms to 30 s, then +Inf.
    assert [le for le, _ in sorted(by["ok"])] == [*CALL_LATENCY_BUCKETS, math.inf]
    assert counts == {"ok": 100, "status": 3, "transport": 0, "timeout": 0,
                      "no_endpoint": 0, "other": 0}  # fmt: skip
    assert sums["ok"] == pytest.approx(98 * 0.002 + 2 * 3.0, abs=1e-6)
    assert sums["status"] == pytest.approx(3 * 0.04, abs=1e-6)
    # histogram_quantile(0.99, sum by (le) (rate(..._bucket{outcome="ok"}[5m]))):
    # rank 99 of 100 falls in (2.5, 5] holding calls 99-100 -> 2.5 + 2.5 * 1/2.
    assert histogram_quantile(0.99, by["ok"]) == pytest.approx(3.75)
    assert histogram_quantile(0.5, by["ok"]) == pytest.approx(0.001 + 0.0015 * 50 / 98)

    # Build and connection info, and the connection's state as a label.
    (build,) = families["nadisc_build_info"].samples
    assert build.name == "nadisc_build_info" and build.value == 1.0 and build.labels["version"]
    (info,) = families["nadisc_discovery_connection_info"].samples
    assert info.labels == {"connection": "primary", "provider": "host"} and info.value == 1.0
    states = {
        s.labels["state"]: s.value for s in families["nadisc_discovery_connection_state"].samples
    }
    assert states == {"pending": 0.0, "prepared": 1.0, "failed": 0.0}
    (ratio,) = families["nadisc_discovery_evidence_age_ratio"].samples
    assert 0.0 <= ratio.value < 1.0

    await promtool_check(text)


def documented_rules() -> str:
    text = DOCS.read_text()
    found = re.search(r"```yaml\n(groups:.*?)```", text, re.S)
    assert found is not None, "docs/observability.md has an alert rules example"
    return found.group(1)


def test_the_documented_alert_rules_are_valid(tmp_path: Path) -> None:
    rules = documented_rules()
    assert "nadisc_discovery_evidence_age_ratio" in rules
    assert "histogram_quantile(0.99" in rules
    promtool = shutil.which("promtool")
    if promtool is None:
        if IN_CI:
            pytest.fail("promtool is not installed (make servers installs prometheus)")
        pytest.skip("promtool is not installed (never skipped under CI=true)")
    path = tmp_path / "rules.yaml"
    path.write_text(rules)
    checked = subprocess.run(
        [promtool, "check", "rules", str(path)], capture_output=True, text=True, check=False
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
