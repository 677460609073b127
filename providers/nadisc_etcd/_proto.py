"""The etcd v3 gRPC messages this provider sends and reads, built at import.

No generated ``*_pb2`` module: the messages are described by the table
below and turned into protobuf classes (``descriptor_pb2`` +
``message_factory``) in a private descriptor pool, so they never collide with
another etcd client's generated modules in the same process (those register
the same full names in protobuf's default pool).

Only the messages and fields used here are listed. Names, types and field
numbers are etcd's own, from (etcd-io/etcd, ``main``):

* ``api/mvccpb/kv.proto``: ``KeyValue`` (key 1, create_revision 2,
  mod_revision 3, version 4, value 5, lease 6) and ``Event`` (type 1, kv 2,
  prev_kv 3);
* ``api/etcdserverpb/rpc.proto``: the request and response messages of
  ``KV.Range/Put/DeleteRange/Txn/Compact``, ``Watch.Watch``,
  ``Lease.LeaseGrant/LeaseRevoke/LeaseKeepAlive/LeaseTimeToLive``,
  ``Maintenance.Status`` and ``Auth.Authenticate``.

A server that sends fields not listed here is fine: protobuf keeps unknown
fields aside and nothing reads them.

:data:`RANGE_COLUMNS` reads a ``RangeResponse``'s bytes column-wise: the
same field numbers, with ``kvs`` (field 2) declared as one message whose
``KeyValue`` fields are repeated. Protobuf merges every occurrence of a
singular message field into one message, appending to its repeated
fields (the protobuf encoding guide, "Last One Wins" / merging of embedded
messages), so the parser in C hands over one list per field (all keys, all
mod revisions, ...) instead of one message object per key-value. A column
is only in step with the keys when every key-value carries that field once:
proto3 leaves out a zero or empty field (a value of ``b""``, a lease of 0),
so the reader checks the column lengths (see ``_grpc._range_response``).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["MESSAGES", "RANGE_COLUMNS", "message"]

_F = descriptor_pb2.FieldDescriptorProto
_BYTES, _INT64, _UINT64, _BOOL, _STRING = (
    _F.TYPE_BYTES,
    _F.TYPE_INT64,
    _F.TYPE_UINT64,
    _F.TYPE_BOOL,
    _F.TYPE_STRING,
)
_MSG, _ENUM = _F.TYPE_MESSAGE, _F.TYPE_ENUM
_REPEATED = _F.LABEL_REPEATED

#: (name, number, type, type name or "", repeated, oneof name or "")
_Field = tuple[str, int, int, str, bool, str]


def _f(
    name: str, number: int, kind: int, ref: str = "", *, many: bool = False, oneof: str = ""
) -> _Field:
    return (name, number, kind, ref, many, oneof)


_HEADER = _f("header", 1, _MSG, ".etcdserverpb.ResponseHeader")

#: package -> message -> fields (numbers from the protos named above).
_TABLE: dict[str, dict[str, list[_Field]]] = {
    "mvccpb": {
        "KeyValue": [
            _f("key", 1, _BYTES),
            _f("create_revision", 2, _INT64),
            _f("mod_revision", 3, _INT64),
            _f("version", 4, _INT64),
            _f("value", 5, _BYTES),
            _f("lease", 6, _INT64),
        ],
        # ``type`` is the EventType enum (PUT = 0, DELETE = 1), read as its number.
        "Event": [
            _f("type", 1, _ENUM, ".mvccpb.Event.EventType"),
            _f("kv", 2, _MSG, ".mvccpb.KeyValue"),
            _f("prev_kv", 3, _MSG, ".mvccpb.KeyValue"),
        ],
    },
    "etcdserverpb": {
        "ResponseHeader": [
            _f("cluster_id", 1, _UINT64),
            _f("member_id", 2, _UINT64),
            _f("revision", 3, _INT64),
            _f("raft_term", 4, _UINT64),
        ],
        # sort_order: NONE 0, ASCEND 1, DESCEND 2; sort_target: KEY 0 ... MOD 3.
        "RangeRequest": [
            _f("key", 1, _BYTES),
            _f("range_end", 2, _BYTES),
            _f("limit", 3, _INT64),
            _f("revision", 4, _INT64),
            _f("sort_order", 5, _INT64),
            _f("sort_target", 6, _INT64),
            _f("keys_only", 8, _BOOL),
            _f("count_only", 9, _BOOL),
        ],
        "RangeResponse": [
            _HEADER,
            _f("kvs", 2, _MSG, ".mvccpb.KeyValue", many=True),
            _f("more", 3, _BOOL),
            _f("count", 4, _INT64),
        ],
        "PutRequest": [_f("key", 1, _BYTES), _f("value", 2, _BYTES), _f("lease", 3, _INT64)],
        "PutResponse": [_HEADER],
        "DeleteRangeRequest": [_f("key", 1, _BYTES), _f("range_end", 2, _BYTES)],
        "DeleteRangeResponse": [_HEADER, _f("deleted", 2, _INT64)],
        "RequestOp": [
            _f(
                "request_delete_range",
                3,
                _MSG,
                ".etcdserverpb.DeleteRangeRequest",
                oneof="request",
            ),
        ],
        # result: EQUAL 0; target: LEASE 4; lease 8 is in the target_union oneof.
        "Compare": [
            _f("result", 1, _INT64),
            _f("target", 2, _INT64),
            _f("key", 3, _BYTES),
            _f("lease", 8, _INT64, oneof="target_union"),
        ],
        "TxnRequest": [
            _f("compare", 1, _MSG, ".etcdserverpb.Compare", many=True),
            _f("success", 2, _MSG, ".etcdserverpb.RequestOp", many=True),
        ],
        "TxnResponse": [_HEADER, _f("succeeded", 2, _BOOL)],
        "CompactionRequest": [_f("revision", 1, _INT64)],
        "CompactionResponse": [_HEADER],
        "WatchCreateRequest": [
            _f("key", 1, _BYTES),
            _f("range_end", 2, _BYTES),
            _f("start_revision", 3, _INT64),
            _f("progress_notify", 4, _BOOL),
        ],
        "WatchRequest": [
            _f(
                "create_request",
                1,
                _MSG,
                ".etcdserverpb.WatchCreateRequest",
                oneof="request_union",
            ),
        ],
        "WatchResponse": [
            _HEADER,
            _f("watch_id", 2, _INT64),
            _f("created", 3, _BOOL),
            _f("canceled", 4, _BOOL),
            _f("compact_revision", 5, _INT64),
            _f("cancel_reason", 6, _STRING),
            _f("fragment", 7, _BOOL),
            _f("events", 11, _MSG, ".mvccpb.Event", many=True),
        ],
        "LeaseGrantRequest": [_f("TTL", 1, _INT64), _f("ID", 2, _INT64)],
        "LeaseGrantResponse": [
            _HEADER,
            _f("ID", 2, _INT64),
            _f("TTL", 3, _INT64),
            _f("error", 4, _STRING),
        ],
        "LeaseRevokeRequest": [_f("ID", 1, _INT64)],
        "LeaseRevokeResponse": [_HEADER],
        "LeaseKeepAliveRequest": [_f("ID", 1, _INT64)],
        "LeaseKeepAliveResponse": [_HEADER, _f("ID", 2, _INT64), _f("TTL", 3, _INT64)],
        "LeaseTimeToLiveRequest": [_f("ID", 1, _INT64)],
        "LeaseTimeToLiveResponse": [
            _HEADER,
            _f("ID", 2, _INT64),
            _f("TTL", 3, _INT64),
            _f("grantedTTL", 4, _INT64),
        ],
        "StatusRequest": [],
        "StatusResponse": [_HEADER, _f("version", 2, _STRING)],
        "AuthenticateRequest": [_f("name", 1, _STRING), _f("password", 2, _STRING)],
        "AuthenticateResponse": [_HEADER, _f("token", 2, _STRING)],
    },
}


#: The column view of ``RangeResponse`` (see the module docstring); not
#: etcd messages, so kept apart from ``_TABLE``.
_VIEWS: dict[str, dict[str, list[_Field]]] = {
    "nadisc_etcd_views": {
        "KeyValueColumns": [
            _f("key", 1, _BYTES, many=True),
            _f("create_revision", 2, _INT64, many=True),
            _f("mod_revision", 3, _INT64, many=True),
            _f("version", 4, _INT64, many=True),
            _f("value", 5, _BYTES, many=True),
            _f("lease", 6, _INT64, many=True),
        ],
        "RangeColumns": [
            _HEADER,
            _f("kvs", 2, _MSG, ".nadisc_etcd_views.KeyValueColumns"),
            _f("more", 3, _BOOL),
            _f("count", 4, _INT64),
        ],
    },
}


def _build() -> dict[str, type[Any]]:
    pool = descriptor_pool.DescriptorPool()
    for package, messages in {**_TABLE, **_VIEWS}.items():
        file = descriptor_pb2.FileDescriptorProto(
            name=f"nadisc_etcd/{package}.proto", package=package, syntax="proto3"
        )
        if package == "etcdserverpb":
            file.dependency.append("nadisc_etcd/mvccpb.proto")
        elif package in _VIEWS:
            file.dependency.append("nadisc_etcd/etcdserverpb.proto")
        for name, fields in messages.items():
            proto = file.message_type.add(name=name)
            if name == "Event":
                enum = proto.enum_type.add(name="EventType")
                enum.value.add(name="PUT", number=0)
                enum.value.add(name="DELETE", number=1)
            oneofs: list[str] = []
            for field_name, number, kind, ref, many, oneof in fields:
                field = proto.field.add(
                    name=field_name,
                    number=number,
                    type=kind,
                    label=_REPEATED if many else _F.LABEL_OPTIONAL,
                )
                if ref:
                    field.type_name = ref
                if oneof:
                    if oneof not in oneofs:
                        oneofs.append(oneof)
                        proto.oneof_decl.add(name=oneof)
                    field.oneof_index = oneofs.index(oneof)
        pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{package}.{name}"))
        for package, messages in {**_TABLE, **_VIEWS}.items()
        for name in messages
    }


_CLASSES = _build()
#: Message name (without package) -> its protobuf class (etcd's messages).
MESSAGES: dict[str, type[Any]] = {
    name: cls for name, cls in _CLASSES.items() if cls.DESCRIPTOR.file.package in _TABLE
}
#: ``RangeResponse`` read column-wise (see the module docstring).
RANGE_COLUMNS: type[Any] = _CLASSES["RangeColumns"]


def message(name: str) -> type[Any]:
    """The class of message ``name`` (``KeyError`` when it is not in the table)."""
    return MESSAGES[name]
