"""A parsed document nested past any real config is a typed error naming where."""

from __future__ import annotations

from typing import Any

import pytest

from nadisc import ConfigError, parse_config
from nadisc._loading import MAX_NESTING


def nested(levels: int, *, key: str = "a") -> dict[str, Any]:
    root: dict[str, Any] = {}
    node = root
    for _ in range(levels):
        node[key] = {}
        node = node[key]
    return root


def nested_list(levels: int) -> list[Any]:
    root: list[Any] = []
    node = root
    for _ in range(levels):
        child: list[Any] = []
        node.append(child)
        node = child
    return root


@pytest.mark.parametrize("levels", [MAX_NESTING + 2, 1_500, 50_000])
@pytest.mark.parametrize("environ", [None, {}])
def test_a_deep_mapping_is_a_config_error_not_recursion(
    levels: int, environ: dict[str, str] | None
) -> None:
    # Over ~1,000 levels the text and literal-secret walks used to raise RecursionError.
    with pytest.raises(ConfigError) as caught:
        parse_config({"discovery": {"connections": nested(levels, key="primary")}}, environ=environ)
    assert caught.value.path.startswith("discovery.connections.primary.primary")
    assert "nested more than" in str(caught.value)


def test_a_deep_list_is_a_config_error_too() -> None:
    with pytest.raises(ConfigError, match="nested more than"):
        parse_config({"discovery": {"connections": nested_list(5_000)}})


def test_reasonable_nesting_still_reaches_validation() -> None:
    # Well under the bound: the ordinary validation answers (an unknown key).
    with pytest.raises(ConfigError) as caught:
        parse_config({"discovery": {"enabled": True, "surplus": nested(20)}})
    assert "nested more than" not in str(caught.value)
