"""Fuzzed configs: every document loads or is one ConfigError with a path and
no planted secret in any message (the nightly-size run is
``python -m benchmarks.config_fuzz --examples 10000``)."""

from __future__ import annotations

import warnings

from hypothesis import HealthCheck, given, settings

from benchmarks.config_fuzz import check, documents


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(documents())
def test_every_document_loads_or_is_one_config_error(document: tuple[str, str]) -> None:
    fmt, text = document
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ConfigWarning on literal placeholders
        assert check(fmt, text) in ("loaded", "ConfigError")


def test_the_documents_that_used_to_escape_are_config_errors() -> None:
    for fmt, text in [
        ("yaml", "discovery:\n  enabled: !!bool abc\n"),
        ("yaml", "discovery:\n  x: !!float ''\n"),
        ("yaml", "discovery:\n  when: 2001-13-45\n"),
        ("toml", "[discovery]\nx = " + "9" * 5000),
        ("json", '{"discovery": {"enabled": true, "default_connection": "\\ud800"}}'),
    ]:
        assert check(fmt, text) == "ConfigError"
