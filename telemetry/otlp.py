"""OTLP trace encoding: finished spans → serialized ``ExportTraceServiceRequest`` bytes.

Written against the protobuf wire format of opentelemetry-proto's ``trace.proto`` and
``common.proto`` (field numbers in the comments below) instead of building the generated
message objects: the stock encoder (``opentelemetry-exporter-otlp-proto-common``) costs
~70 µs a span on this project's dev box, more than the gateway spends on a whole request.
Attribute key/value pairs repeat across requests (tenant, model, versions), so their
encodings are cached. Tests decode the output with opentelemetry-proto.

``telemetry/_otlp.c`` is the same ``record`` in C (~10× faster), built by ``pip install``
where a C compiler is present (``NATIVE`` says whether it was); both produce the same
bytes for every input (tests/telemetry/test_export.py), and ``SLUICE_OTLP_NATIVE=0`` turns
the C one off.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, count, repeat
from operator import is_
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .tracing import Span

Record = tuple[Any, ...]  # see to_record

_pack_d = struct.Struct("<d").pack
_pack_q = struct.Struct("<Q").pack
_pack_i = struct.Struct("<I").pack
_times = struct.Struct("<BQBQ").pack  # start (7) and end (8): tag, fixed64, tag, fixed64

try:
    from . import _otlp as _native  # type: ignore[attr-defined]  # a C extension, no stub
except ImportError:  # no C compiler at install time: the pure-Python encoder
    _native = None
NATIVE = _native is not None and os.environ.get("SLUICE_OTLP_NATIVE", "1") != "0"

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


def _get_hashable(cache: Mapping[tuple[str, Any], bytes], item: tuple[str, Any]) -> bytes | None:
    try:
        return cache.get(item)
    except TypeError:
        return None


class Encoder:
    """Encodes batches of finished spans. One per exporter thread (its cache is unlocked)."""

    def __init__(self, resource: Mapping[str, Any], native: bool | None = None) -> None:
        self.native = NATIVE if native is None else (native and _native is not None)
        self._resource = _ld(1, b"".join(_ld(1, key_value(k, v))
                                         for k, v in resource.items()))
        # Whole encoded fields, per field number, keyed by the attribute's (key, value) item
        # as ``dict.items()`` yields it, so that a span whose attributes are all cached is
        # encoded without running Python code per attribute (``map(cache.get, items)``).
        # Only string values (and tuples of strings) go in: no other value compares equal
        # to a string, while True == 1 == 1.0 would mix up bool, int and float.
        self._fields: dict[int, dict[tuple[str, Any], bytes]] = {}
        self._ints: dict[tuple[int, str, int], bytes] = {}  # int attributes, looked up by type
        self._keys: dict[str, bytes] = {}  # other attributes: the encoded key
        self._scopes: dict[tuple[str, str], bytes] = {}
        self._names: dict[tuple[str, int], bytes] = {}  # name (5) and kind (6) fields

    def attributes(self, tag: int, attrs: Mapping[str, Any]) -> bytes:
        """Repeated ``KeyValue`` fields numbered ``tag`` (< 16), in the mapping's order.
        Strings are cached as whole fields (tenant, model, versions repeat), and so are
        ints; floats and bools are framed around a cached key."""
        cache = self._fields.get(tag)
        if cache is None:
            cache = self._fields[tag] = {}
        items = list(attrs.items())
        try:
            parts: list[bytes | None] = list(map(cache.get, items))
        except TypeError:  # an unhashable value (a list)
            parts = [_get_hashable(cache, item) for item in items]
        if None not in parts:
            return b"".join(parts)  # type: ignore[arg-type]  # no None in parts; a cast costs a call here
        ints = self._ints
        keys = self._keys
        head = _SMALL[tag << 3 | 2]
        for i in compress(count(), map(is_, parts, repeat(None))):  # the misses only
            k, v = items[i]
            t = type(v)
            if t is str or (t is tuple and all(type(x) is str for x in v)):
                if len(cache) >= _KV_CACHE_MAX:
                    cache.clear()
                parts[i] = cache[(k, v)] = _ld(tag, key_value(k, v))
                continue
            if t is int:
                field = ints.get((tag, k, v))
                if field is None:
                    if len(ints) >= _KV_CACHE_MAX:
                        ints.clear()
                    field = ints[(tag, k, v)] = _ld(tag, key_value(k, v))
                parts[i] = field
                continue
            if t is float:
                value = b"\x21" + _pack_d(v)  # AnyValue.double_value (4)
            elif t is bool:
                value = b"\x10\x01" if v else b"\x10\x00"
            else:
                # None is no value (the API drops it), not "None"
                parts[i] = b"" if v is None else _ld(tag, key_value(k, v))
                continue
            key = keys.get(k)
            if key is None:
                if len(keys) >= _KV_CACHE_MAX:
                    keys.clear()
                key = keys[k] = _str(1, k)
            # KeyValue: key, then value (2) = the AnyValue (always < 128 bytes here)
            n = len(key) + 2 + len(value)
            parts[i] = b"".join((head, _SMALL[n] if n < 0x80 else _varint(n), key, b"\x12",
                                 _SMALL[len(value)], value))
        return b"".join(parts)  # type: ignore[arg-type]  # every None was filled; a cast costs a call here

    def _name(self, name: str, kind: int) -> bytes:
        out = self._names.get((name, kind))
        if out is None:
            if len(self._names) >= _KV_CACHE_MAX:
                self._names.clear()
            out = self._names[(name, kind)] = _str(5, name) + _KIND[kind]
        return out

    def span(self, s: Span) -> bytes:
        return self.record(to_record(s))

    def record(self, r: Record) -> bytes:
        """A span tree (``to_record``) as ``ScopeSpans.spans`` fields (the C encoder when
        built; the pure-Python one for shapes it does not take, such as attributes in a
        Mapping that is not a dict)."""
        native = _native
        if self.native and native is not None:
            try:
                encoded: bytes = native.record(r, any_value)
                return encoded
            except TypeError:
                pass
        return self.record_py(r)

    def record_py(self, r: Record) -> bytes:
        """The pure-Python encoder. ``Span``: trace_id 1,
        span_id 2, trace_state 3, parent_span_id 4, name 5, kind 6, start 7, end 8,
        attributes 9, events 11, links 13, status 15, flags 16."""
        (_, trace_id, span_id, flags, state_header, parent_id, parent_remote, name, kind,
         start, end, attrs, events, links, status_code, status_message, children) = r
        ids = b"\x0a\x10" + trace_id.to_bytes(16, "big")
        own = span_id.to_bytes(8, "big")
        state = _str(3, state_header) if state_header else b""
        out = [ids, b"\x12\x08", own, state,
               b"\x22\x08" + parent_id.to_bytes(8, "big") if parent_id else b"",
               self._name(name, kind), _times(0x39, start, 0x41, end or start)]
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
        # a child: ids, own id, trace state, parent (the root), name + kind, times,
        # attributes, flags; everything but its id, times and attributes is shared
        shared = b"".join((state, b"\x22\x08", own))
        tail = b"\x85\x01" + _pack_i(flags | 0x100)
        parts = [encoded]
        append = parts.append
        for c_name, c_id, c_start, c_end, c_attrs, c_kind in children:
            c_attrs_field = self.attributes(9, c_attrs) if c_attrs else b""
            c_name_field = self._name(c_name, c_kind)
            # 18 ids + 10 own id + 18 times + 6 flags = 52
            n = 52 + len(shared) + len(c_name_field) + len(c_attrs_field)
            append(b"".join((b"\x12", _SMALL[n] if n < 0x80 else _varint(n), ids,
                             b"\x12\x08", c_id.to_bytes(8, "big"), shared, c_name_field,
                             _times(0x39, c_start, 0x41, c_end), c_attrs_field, tail)))
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
    ctx = s.context  # a tuple: (trace_id, span_id, is_remote, trace_flags, trace_state, …)
    state = ctx[4]
    return (s.scope, ctx[0], ctx[1], int(ctx[3]),
            state.to_header() if state is not None and len(state) else "", s.parent_id,
            s.parent_remote, s.name, s.kind_code, s.start_ns, s.end_ns, s.attributes,
            s.events, [(lk.context.trace_id, lk.context.span_id,
                        dict(lk.attributes) if lk.attributes else None) for lk in s.links]
            if s.links else (),
            s.status_code, s.status_message, s.children)
