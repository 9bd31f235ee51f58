"""OTLP trace encoding: finished spans → serialized ``ExportTraceServiceRequest`` bytes.

Written against the protobuf wire format of opentelemetry-proto's ``trace.proto`` and
``common.proto`` (field numbers in the comments below) instead of building the generated
message objects: the stock encoder (``opentelemetry-exporter-otlp-proto-common``) costs
~70 µs a span on this project's dev box, more than the gateway spends on a whole request.
Attribute key/value pairs repeat across requests (tenant, model, versions), so their
encodings are cached. Tests decode the output with opentelemetry-proto.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tracing import Span

Record = tuple[Any, ...]  # see to_record

_pack_d = struct.Struct("<d").pack
_pack_q = struct.Struct("<Q").pack
_pack_i = struct.Struct("<I").pack

_KV_CACHE_MAX = 8192
_KIND = [b"\x30" + bytes((k,)) for k in range(6)]  # Span.kind (field 6), proto values


_SMALL = [bytes((i,)) for i in range(128)]


def _varint(n: int) -> bytes:
    if n < 0x80:
        return _SMALL[n]
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _ld(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (wire type 2); ``tag`` is the field number (< 16)."""
    n = len(payload)
    return _SMALL[tag << 3 | 2] + (_SMALL[n] if n < 0x80 else _varint(n)) + payload


def _str(tag: int, value: str) -> bytes:
    return _ld(tag, value.encode("utf-8", "replace"))


def any_value(value: Any) -> bytes:
    """``AnyValue``: string 1, bool 2, int 3, double 4, array 5, kvlist 6, bytes 7."""
    if isinstance(value, str):
        return _str(1, value)
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x18" + _varint(value & 0xFFFFFFFFFFFFFFFF)  # int64: two's complement
    if isinstance(value, float):
        return b"\x21" + _pack_d(value)
    if isinstance(value, (bytes, bytearray)):
        return _ld(7, bytes(value))
    if isinstance(value, Mapping):
        return _ld(6, b"".join(_ld(1, key_value(str(k), v)) for k, v in value.items()))
    if isinstance(value, Sequence):
        return _ld(5, b"".join(_ld(1, any_value(v)) for v in value))
    return _str(1, str(value))


def key_value(key: str, value: Any) -> bytes:
    """``KeyValue``: key 1, value 2 (the message body, without its own tag)."""
    return _str(1, key) + _ld(2, any_value(value))


class Encoder:
    """Encodes batches of finished spans. One per exporter thread (its cache is unlocked)."""

    def __init__(self, resource: Mapping[str, Any]) -> None:
        self._resource = _ld(1, b"".join(_ld(1, key_value(k, v))
                                         for k, v in resource.items()))
        self._kv: dict[tuple[str, str], bytes] = {}  # string attributes: the whole field
        self._keys: dict[str, bytes] = {}  # other attributes: the encoded key
        self._scopes: dict[tuple[str, str], bytes] = {}
        self._names: dict[str, bytes] = {}

    def attributes(self, tag: int, attrs: Mapping[str, Any]) -> bytes:
        """Repeated ``KeyValue`` fields numbered ``tag`` (< 16). Strings are cached as whole
        fields (tenant, model, versions repeat); numbers are framed around a cached key."""
        strings = self._kv
        keys = self._keys
        head = _SMALL[tag << 3 | 2]
        parts = []
        for k, v in attrs.items():
            t = type(v)
            if t is str:
                field = strings.get((k, v))
                if field is None:
                    if len(strings) >= _KV_CACHE_MAX:
                        strings.clear()
                    field = strings[(k, v)] = _ld(tag, key_value(k, v))
                parts.append(field)
                continue
            if t is int:
                value = b"\x18" + _varint(v & 0xFFFFFFFFFFFFFFFF)  # AnyValue.int_value (3)
            elif t is float:
                value = b"\x21" + _pack_d(v)  # AnyValue.double_value (4)
            elif t is bool:
                value = b"\x10\x01" if v else b"\x10\x00"
            else:
                if v is not None:  # None is no value (the API drops it), not "None"
                    parts.append(_ld(tag, key_value(k, v)))
                continue
            key = keys.get(k)
            if key is None:
                if len(keys) >= _KV_CACHE_MAX:
                    keys.clear()
                key = keys[k] = _str(1, k)
            # KeyValue: key, then value (2) = the AnyValue (always < 128 bytes here)
            body = key + b"\x12" + _SMALL[len(value)] + value
            n = len(body)
            parts.append(head + (_SMALL[n] if n < 0x80 else _varint(n)) + body)
        return b"".join(parts)

    def _name(self, name: str) -> bytes:
        out = self._names.get(name)
        if out is None:
            if len(self._names) >= _KV_CACHE_MAX:
                self._names.clear()
            out = self._names[name] = _str(5, name)
        return out

    def span(self, s: Span) -> bytes:
        return self.record(to_record(s))

    def record(self, r: Record) -> bytes:
        """A span tree (``to_record``) as ``ScopeSpans.spans`` fields. ``Span``: trace_id 1,
        span_id 2, trace_state 3, parent_span_id 4, name 5, kind 6, start 7, end 8,
        attributes 9, events 11, links 13, status 15, flags 16."""
        (_, trace_id, span_id, flags, state_header, parent_id, parent_remote, name, kind,
         start, end, attrs, events, links, status_code, status_message, children) = r
        ids = b"\x0a\x10" + trace_id.to_bytes(16, "big")
        own = span_id.to_bytes(8, "big")
        state = _str(3, state_header) if state_header else b""
        out = [ids + b"\x12\x08" + own + state
               + (b"\x22\x08" + parent_id.to_bytes(8, "big") if parent_id else b"")
               + self._name(name) + _KIND[kind] + b"\x39" + _pack_q(start)
               + b"\x41" + _pack_q(end or start)]
        if attrs:
            out.append(self.attributes(9, attrs))
        for event, t_ns, event_attrs in events:
            # Event: time 1 (fixed64), name 2, attributes 3
            out.append(_ld(11, b"\x09" + _pack_q(t_ns) + _str(2, event)
                           + (self.attributes(3, event_attrs) if event_attrs else b"")))
        for link_trace, link_span, link_attrs in links:
            out.append(_ld(13, b"\x0a\x10" + link_trace.to_bytes(16, "big") + b"\x12\x08"
                           + link_span.to_bytes(8, "big")
                           + (self.attributes(4, link_attrs) if link_attrs else b"")))
        if status_code:
            # Status: message 2, code 3
            status = (_str(2, status_message) if status_message else b"") \
                + b"\x18" + _varint(status_code)
            out.append(_ld(15, status))
        out.append(b"\x85\x01" + _pack_i(flags | 0x100 | (0x200 if parent_remote else 0)))
        encoded = _ld(2, b"".join(out))
        if not children:
            return encoded
        parent = b"\x22\x08" + own
        tail = b"\x85\x01" + _pack_i(flags | 0x100)
        parts = [encoded]
        for c_name, c_id, c_start, c_end, c_attrs, c_kind in children:
            body = (ids + b"\x12\x08" + c_id.to_bytes(8, "big") + state + parent
                    + self._name(c_name) + _KIND[c_kind] + b"\x39" + _pack_q(c_start)
                    + b"\x41" + _pack_q(c_end)
                    + (self.attributes(9, c_attrs) if c_attrs else b"") + tail)
            parts.append(_ld(2, body))
        return b"".join(parts)

    def prepare(self, s: Span) -> tuple[tuple[str, str], bytes, int]:
        """A finished span (and its batched children) as (scope, encoding, span count),
        ready for ``request``."""
        return self.prepare_record(to_record(s))

    def prepare_record(self, r: Record) -> tuple[tuple[str, str], bytes, int]:
        scope = (str(r[0][0]), str(r[0][1]))  # marshal keeps tuples, but be exact
        return scope, self.record(r), 1 + len(r[16])

    def request(self, items: Iterable[tuple[tuple[str, str], bytes, int]]) -> bytes:
        """``ExportTraceServiceRequest`` → ResourceSpans (1) → ScopeSpans (2) per scope."""
        by_scope: dict[tuple[str, str], list[bytes]] = {}
        for scope, encoded, _ in items:
            by_scope.setdefault(scope, []).append(encoded)
        scopes = []
        for scope, spans in by_scope.items():
            head = self._scopes.get(scope)
            if head is None:
                name, version = scope
                head = self._scopes[scope] = _ld(1, _str(1, name)
                                                 + (_str(2, version) if version else b""))
            scopes.append(_ld(2, head + b"".join(spans)))
        return _ld(1, self._resource + b"".join(scopes))


def to_record(s: Span) -> Record:
    """A finished span tree as plain values: what the encoder reads, and what ``marshal``
    carries to the shipper process (telemetry.shipper)."""
    ctx = s.context
    return (s.scope, ctx.trace_id, ctx.span_id, int(ctx.trace_flags),
            ctx.trace_state.to_header() if ctx.trace_state else "", s.parent_id,
            s.parent_remote, s.name, s.kind_code, s.start_ns, s.end_ns, s.attributes,
            s.events, [(lk.context.trace_id, lk.context.span_id,
                        dict(lk.attributes) if lk.attributes else None) for lk in s.links],
            s.status_code, s.status_message,
            [(c.name, c.span_id, c.start_ns, c.end_ns, c.attributes, c.kind_code)
             for c in s.children])
