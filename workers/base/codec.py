"""Canonical msgpack: the only place forkq encodes or decodes msgpack, and the record digest.

Canonical means: map keys sorted (str keys only), the smallest integer forms, bytes as msgpack
`bin` and str as `str`, so equal values always give identical bytes and one digest. No extension
types are written or accepted (no pickle, no custom objects).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Final

import msgpack
import ormsgpack

from workers.errors import RecordDecodeError

DIGEST_SIZE: Final = 32  # BLAKE2b-256
_PACK_OPTIONS: Final = ormsgpack.OPT_SORT_KEYS


def encode(value: Any) -> bytes:
    """Canonical msgpack bytes of plain data (dict with str keys, list, str, bytes, int, bool, None).

    Raises:
        TypeError: the value holds something that is not plain data, or a non-str map key.
    """
    try:
        return ormsgpack.packb(value, option=_PACK_OPTIONS)
    except ormsgpack.MsgpackEncodeError as exc:
        raise TypeError(f"cannot encode as a forkq record: {exc}; records hold only plain data with str keys") from exc


def decode(data: bytes, *, what: str = "record") -> Any:
    """Plain data from msgpack bytes.

    Raises:
        RecordDecodeError: the bytes are not one complete msgpack value of plain data with str keys.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise RecordDecodeError(f"{what}: expected msgpack bytes, got {type(data).__name__}")
    try:
        # msgpack (not ormsgpack) decodes: it refuses trailing bytes, and with these options int map keys,
        # invalid UTF-8 and every extension type (ormsgpack would silently ignore trailing garbage)
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, ext_hook=_refuse_ext, object_hook=_str_keys_only, use_list=True
        )
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise RecordDecodeError(
            f"{what}: {len(data)} bytes are not a forkq msgpack record ({exc or type(exc).__name__}); "
            "records are canonical msgpack maps with str keys and no extension types",
            cause=exc,
        ) from exc


def decode_verified(data: bytes, *, what: str = "record") -> Any:
    """`decode` for bytes whose digest was just checked against a digest we wrote: they are exactly
    what `encode` produced (one canonical value, str keys, no extension types), so the faster
    decoder, which skips the framing checks of `decode`, is safe.

    Raises:
        RecordDecodeError: the bytes do not decode (only possible if the digest check was skipped).
    """
    try:
        return ormsgpack.unpackb(data)
    except (ormsgpack.MsgpackDecodeError, ValueError, TypeError) as exc:
        raise RecordDecodeError(f"{what}: {len(data)} bytes do not decode ({exc})", cause=exc) from exc


@dataclass(frozen=True, slots=True)
class MessageBounds:
    """What one broker message body may hold: containers, elements over all arrays, entries per map, bytes per value."""

    containers: int
    elements: int
    map_entries: int
    bin_bytes: int
    str_bytes: int


def encode_message(value: Any) -> bytes:
    """A broker message body (a Celery task's `[args, kwargs, embed]`): msgpack, bytes as `bin`, as kombu writes it."""
    return bytes(msgpack.packb(value, use_bin_type=True))


def decode_message(data: bytes, bounds: MessageBounds, *, what: str = "message body") -> Any:
    """Plain data from a broker message body, refused as soon as it holds more than `bounds` allows.

    msgpack's own limits bound each container and value; the hooks bound how many containers there
    are and how many elements they hold together: without them a body of empty arrays (one byte
    each) becomes a Python list per byte, 892 MiB of memory for a 12 MiB body.

    Raises:
        RecordDecodeError: not one msgpack value of plain data within `bounds`.
    """
    budget = [bounds.containers, bounds.elements]

    def spend(container: Any) -> Any:
        budget[0] -= 1
        budget[1] -= len(container)
        if budget[0] < 0 or budget[1] < 0:
            raise ValueError(f"more than {bounds.containers:,} arrays and maps or {bounds.elements:,} elements in all")
        return container

    def checked_map(mapping: dict[Any, Any]) -> Any:
        return spend(_str_keys_only(mapping))

    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,
            object_hook=checked_map,
            list_hook=spend,
            use_list=True,
            max_array_len=bounds.elements,
            max_map_len=bounds.map_entries,
            max_bin_len=bounds.bin_bytes,
            max_str_len=bounds.str_bytes,
            max_ext_len=0,
        )
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise RecordDecodeError(
            f"{what}: {len(data):,} bytes are not a forkq job ({exc or type(exc).__name__}); a job is a msgpack "
            f"Celery body of at most {bounds.containers} arrays and maps, {bounds.bin_bytes:,} bytes per value",
            cause=exc,
        ) from exc


def _str_keys_only(mapping: dict[Any, Any]) -> dict[Any, Any]:
    # strict_map_key still admits bytes keys; records have str keys only
    for key in mapping:
        if type(key) is not str:
            raise ValueError(f"map key {key!r} is not a str")
    return mapping


def _refuse_ext(code: int, data: bytes) -> Any:
    raise ValueError(f"extension type {code} is not allowed")


def digest(data: bytes) -> str:
    """BLAKE2b-256 hex digest of encoded bytes."""
    return hashlib.blake2b(data, digest_size=DIGEST_SIZE).hexdigest()


def encode_with_digest(value: Any) -> tuple[bytes, str]:
    """`encode(value)` and its digest."""
    data = encode(value)
    return data, digest(data)


def encode_map(fields: dict[str, Any], encoded: dict[str, bytes]) -> bytes:
    """`encode` of the map of `fields` and `encoded`, whose values are already-encoded: the same bytes,
    without re-encoding those values (keys sorted as `encode` sorts them; str keys only)."""
    items = sorted([*((k, encode(v)) for k, v in fields.items()), *encoded.items()])
    n = len(items)
    if n < 16:
        header = bytes([0x80 | n])
    elif n < 1 << 16:
        header = b"\xde" + n.to_bytes(2, "big")
    else:
        header = b"\xdf" + n.to_bytes(4, "big")
    return header + b"".join(encode(k) + v for k, v in items)


def encode_array(items: list[bytes]) -> bytes:
    """The msgpack array whose elements are the given already-encoded values, without re-encoding them."""
    n = len(items)
    if n < 16:
        header = bytes([0x90 | n])
    elif n < 1 << 16:
        header = b"\xdc" + n.to_bytes(2, "big")
    else:
        header = b"\xdd" + n.to_bytes(4, "big")
    return header + b"".join(items)
