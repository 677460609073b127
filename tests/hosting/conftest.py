"""The hosting tests use the session's real etcd, or a private one for a test
that stops its server (see tests/providers/etcd/conftest.py)."""

from tests.providers.etcd.conftest import etcd_server, own_etcd

__all__ = ["etcd_server", "own_etcd"]
