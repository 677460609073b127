"""The hosting tests use the session's real etcd (see tests/providers/etcd/conftest.py)."""

from tests.providers.etcd.conftest import etcd_server

__all__ = ["etcd_server"]
