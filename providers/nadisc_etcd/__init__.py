"""etcd provider for nadisc: v3 JSON gateway (httpx) or v3 gRPC, gRPC-resolver key layout.

Discovery ranges and watches ``<prefix>/<service>/`` (evidence: a lease the
registrant keeps alive); registration writes the record on a lease and
renews it with keepalives. Installed under the ``nadisc.providers`` entry
point ``etcd``; see ``docs/providers-etcd.md``.
"""

from ._client import EtcdClient as EtcdClient
from ._layout import Layout as Layout
from ._layout import RecordError as RecordError
from ._layout import decode_record as decode_record
from ._layout import decode_record_bytes as decode_record_bytes
from ._layout import encode_record as encode_record
from ._provider import EtcdProvider as EtcdProvider
from ._provider import EtcdProviderFactory as EtcdProviderFactory
from ._provider import EtcdStatistics as EtcdStatistics
from ._provider import factory as factory
from ._settings import EtcdServiceBinding as EtcdServiceBinding
from ._settings import EtcdSettings as EtcdSettings

__all__ = [
    "EtcdClient",
    "EtcdProvider",
    "EtcdProviderFactory",
    "EtcdServiceBinding",
    "EtcdSettings",
    "EtcdStatistics",
    "Layout",
    "RecordError",
    "decode_record",
    "decode_record_bytes",
    "encode_record",
    "factory",
]
