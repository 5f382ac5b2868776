"""The protobuf wire format of the requests kubelet sends the plugin, read strictly.

Every request is checked here before anything else sees it: the bytes must be
a complete message (no field that claims more bytes than follow, no cut-off
varint), known fields must have their declared wire type, and strings must be
UTF-8. betterproto2 accepts truncated input, and decodes every field before
anything can count them; the readers below stop at the first field past a
limit. Answers are betterproto2's.

Field numbers and kinds are those of protos/deviceplugin_v1beta1.proto;
tests/test_fuzz.py sends them as protobuf's own encoder writes them.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator, Mapping

import grpclib.const
import grpclib.exceptions


class WireError(ValueError):
    """Bytes that are not a well-formed message of the expected type; says where."""


class TooMany(Exception):
    """More items than the caller allows; reading stopped there."""


class TooLong(Exception):
    """A string longer than the caller allows; it was not decoded."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


class TooManyContainers(TooMany):
    """More container requests than the caller allows."""


class TooManyOthers(TooMany):
    """More fields besides the repeated one read than the caller allows."""


class Kind(enum.Enum):
    STRING = "string"
    VARINT = "varint"


# A flat message's known fields: number -> (name, kind). Messages with repeated or nested
# fields have readers of their own below, which count as they read.
Schema = Mapping[int, tuple[str, Kind]]

# Empty, and what a method reads nothing of: its fields are skipped, its framing checked.
EMPTY: Schema = {}

# DRA (protos/dra_v1.proto, protos/pluginregistration.proto): the Claim of
# NodePrepareResourcesRequest and NodeUnprepareResourcesRequest (read by read_claims_request);
# RegistrationStatus.
CLAIM: Schema = {
    1: ("namespace", Kind.STRING),
    2: ("uid", Kind.STRING),
    3: ("name", Kind.STRING),
}
REGISTRATION_STATUS: Schema = {1: ("plugin_registered", Kind.VARINT), 2: ("error", Kind.STRING)}

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
_WIRE_NAMES = {0: "varint", 1: "64-bit", 2: "length-delimited", 5: "32-bit"}


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while pos < end:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            raise WireError(f"a varint longer than 10 bytes at byte {pos}")
    raise WireError(f"the message ends inside a varint at byte {end}")


def _skip(data: bytes, pos: int, end: int, wire_type: int, number: int) -> int:
    """The position after an unknown field's value (proto3 parsers skip unknown fields)."""
    if wire_type == _VARINT:
        return _varint(data, pos, end)[1]
    size = {_FIXED64: 8, _FIXED32: 4}.get(wire_type)
    if wire_type == _LENGTH:
        size, pos = _varint(data, pos, end)
    if size is None:
        raise WireError(f"field {number} has wire type {wire_type}, which proto3 does not use")
    if pos + size > end:
        raise WireError(f"field {number} claims {size} bytes, {end - pos} follow")
    return pos + size


def _text(data: bytes, start: int, stop: int, name: str) -> str:
    try:
        return data[start:stop].decode()
    except UnicodeDecodeError:
        raise WireError(f"field {name} is not valid UTF-8") from None


def _field_key(data: bytes, pos: int, end: int) -> tuple[int, int, int]:
    """The field number and wire type of the key at `pos`, and where its value begins."""
    key, pos = _varint(data, pos, end)
    if key >> 3 == 0:
        raise WireError("field number 0 is not allowed")
    return key >> 3, key & 7, pos


def check(data: bytes, schema: Schema, start: int = 0, end: int | None = None) -> dict[str, str]:
    """Raise WireError unless `data[start:end]` is a complete, well-typed message of `schema`;
    its string fields, the last value of each as in proto3 ("" when absent)."""
    end = len(data) if end is None else end
    found = {name: "" for name, kind in schema.values() if kind is Kind.STRING}
    pos = start
    while pos < end:
        number, wire_type, pos = _field_key(data, pos, end)
        known = schema.get(number)
        if known is None:
            pos = _skip(data, pos, end, wire_type, number)
            continue
        name, kind = known
        wanted = _VARINT if kind is Kind.VARINT else _LENGTH
        if wire_type != wanted:
            raise WireError(
                f"field {name} is sent as {_WIRE_NAMES.get(wire_type, wire_type)}, "
                f"not {_WIRE_NAMES[wanted]}"
            )
        if kind is Kind.VARINT:
            pos = _varint(data, pos, end)[1]
            continue
        size, pos = _varint(data, pos, end)
        if pos + size > end:
            raise WireError(f"field {name} claims {size} bytes, {end - pos} follow")
        found[name] = _text(data, pos, pos + size, name)
        pos += size
    return found


def check_request(data: bytes, schema: Schema, name: str) -> None:
    """`check`, failing as the gRPC answer INVALID_ARGUMENT, which names the message."""
    try:
        check(data, schema)
    except WireError as exc:
        raise grpclib.exceptions.GRPCError(
            grpclib.const.Status.INVALID_ARGUMENT, f"cannot decode {name}: {exc}"
        ) from None


def _values_of_field_1(
    data: bytes, start: int, end: int, name: str, max_others: int | None = None
) -> Iterator[tuple[int, int]]:
    """Where each value of field 1 (`name`, repeated, length-delimited) lies in the message
    `data[start:end]`, in order; other fields are skipped, TooManyOthers past `max_others` of
    them. Raises WireError where a byte is not as the field or the wire format demands."""
    pos = start
    others = 0
    while pos < end:
        number, wire_type, pos = _field_key(data, pos, end)
        if number != 1:
            others += 1
            if max_others is not None and others > max_others:
                raise TooManyOthers(max_others)
            pos = _skip(data, pos, end, wire_type, number)
            continue
        if wire_type != _LENGTH:
            raise WireError(f"field {name} is sent as {_WIRE_NAMES.get(wire_type, wire_type)}")
        size, pos = _varint(data, pos, end)
        if pos + size > end:
            raise WireError(f"field {name} claims {size} bytes, {end - pos} follow")
        yield pos, pos + size
        pos += size


def read_device_ids(
    data: bytes, limit: int, longest: int, start: int = 0, end: int | None = None
) -> list[str]:
    """The device IDs of a ContainerAllocateRequest or PreStartContainerRequest.

    Raises WireError at the first malformed byte, TooMany as soon as there are
    more than `limit`, and TooLong for an ID of more than `longest` bytes.
    """
    ids: list[str] = []
    for begin, stop in _values_of_field_1(data, start, len(data) if end is None else end,
                                          "devices_ids"):  # fmt: skip
        if len(ids) == limit:
            raise TooMany(limit)
        if stop - begin > longest:
            raise TooLong(stop - begin)
        ids.append(_text(data, begin, stop, "devices_ids"))
    return ids


def read_allocate_request(
    data: bytes, max_containers: int, max_ids: int, longest: int
) -> list[list[str]]:
    """The device IDs of each container request, at most `max_ids` in all, none longer
    than `longest` bytes.

    Raises WireError for malformed bytes, TooManyContainers, TooMany (IDs) or
    TooLong as soon as a limit is passed, without reading further.
    """
    containers: list[list[str]] = []
    total = 0
    for begin, stop in _values_of_field_1(data, 0, len(data), "container_requests"):
        if len(containers) == max_containers:
            raise TooManyContainers(max_containers)
        try:
            ids = read_device_ids(data, max_ids - total, longest, begin, stop)
        except TooMany:
            raise TooMany(max_ids) from None
        total += len(ids)
        containers.append(ids)
    return containers


def read_claims_request(data: bytes, limit: int, longest: int) -> list[dict[str, str]]:
    """The claims of a NodePrepareResourcesRequest or NodeUnprepareResourcesRequest, each
    with its namespace, uid and name ("" when absent), in order.

    Raises WireError at the first malformed byte, TooMany as soon as there are more than
    `limit` claims, TooManyOthers past `limit` other fields (kubelet sends none), TooLong for
    a claim of more than `longest` bytes; nothing after that is read.
    """
    claims: list[dict[str, str]] = []
    for begin, stop in _values_of_field_1(data, 0, len(data), "claims", max_others=limit):
        if len(claims) == limit:
            raise TooMany(limit)
        if stop - begin > longest:
            raise TooLong(stop - begin)
        claims.append(check(data, CLAIM, begin, stop))
    return claims
