"""Servers for the docs' examples: the real etcd the etcd provider tests use
(one per session, on free loopback ports; missing under ``CI=true`` fails)."""

from __future__ import annotations

from tests.providers.etcd.conftest import etcd_server

__all__ = ["etcd_server"]
