"""Fuzzing the daemon's gRPC surface with hypothesis, from a grpcio client.

Arbitrary bytes, arbitrary protobuf wire data, and arbitrary AllocateRequest,
PreferredAllocationRequest and PreStartContainerRequest contents (unknown fields, duplicate,
empty, huge and invalid UTF-8 device IDs, thousands of container requests) all get a
well-formed answer or gRPC error: never UNKNOWN, never a crash or a hang, never a traceback in
the log, and kubelet's own stream lives through all of it.

One daemon serves the whole module. The ``ci`` profile (the default) is deterministic with a
fixed example count; ``PCC_FUZZ_PROFILE=deep`` runs many more, randomly.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from typing import Any

import attrs
import grpc
import pytest
import trio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pcc_plugin.limits import DEFAULT
from pcc_plugin.sim import Daemon, FakeNode, SimKubelet, run_blocking
from pcc_plugin.sim._pb import deviceplugin_v1beta1_pb2 as pb
from pcc_plugin.sim.rules import (
    ALLOCATE,
    GET_DEVICE_PLUGIN_OPTIONS,
    GET_PREFERRED_ALLOCATION,
    LIST_AND_WATCH,
    PRE_START_CONTAINER,
)

pytestmark = pytest.mark.slow

settings.register_profile(
    "ci",
    deadline=None,
    derandomize=True,
    max_examples=100,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "deep",
    deadline=None,
    max_examples=2000,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
PROFILE = settings.get_profile(os.environ.get("PCC_FUZZ_PROFILE", "ci"))

RESOURCE = "tke.cloud.tencent.com/pcc-device"
KNOWN_IDS = [f"pcc-{index}" for index in range(16)]
OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
UNIMPLEMENTED = grpc.StatusCode.UNIMPLEMENTED
# Every answer the daemon may give; UNKNOWN, INTERNAL or DEADLINE_EXCEEDED never.
WELL_FORMED = {OK, INVALID, UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION}
UNARY_METHODS = (ALLOCATE, GET_PREFERRED_ALLOCATION, PRE_START_CONTAINER, GET_DEVICE_PLUGIN_OPTIONS)
CALL_TIMEOUT = 20.0
# As kubelet's grpc-go client: headers and trailers up to 16 MiB, where grpcio stops at 8 KiB.
KUBELET_CHANNEL_OPTIONS = [
    ("grpc.default_authority", "localhost"),
    ("grpc.max_metadata_size", 16 << 20),
    ("grpc.absolute_max_metadata_size", 16 << 20),
]
RESPONSE_TYPES: dict[str, Any] = {
    ALLOCATE: pb.AllocateResponse,
    GET_PREFERRED_ALLOCATION: pb.PreferredAllocationResponse,
    PRE_START_CONTAINER: pb.PreStartContainerResponse,
    GET_DEVICE_PLUGIN_OPTIONS: pb.DevicePluginOptions,
}


# The daemon under fire


@attrs.frozen
class Target:
    node: FakeNode
    kubelet: SimKubelet
    daemon: Daemon
    channel: Any
    channel_target: str


def _as_is(data: bytes) -> bytes:
    return data


@pytest.fixture(scope="module")
def target() -> Iterator[Target]:
    node = FakeNode.create()
    try:
        with SimKubelet(node.plugin_dir) as kubelet:
            daemon = Daemon.spawn_plugin(node.daemon_args(verbosity=0), node.root / "daemon.log")
            try:
                kubelet.wait_for(lambda: kubelet.stream_open(RESOURCE), 20)
                endpoint = kubelet.registrations[-1].endpoint
                channel_target = f"unix:{node.plugin_dir / endpoint}"
                with grpc.insecure_channel(channel_target, KUBELET_CHANNEL_OPTIONS) as channel:
                    yield Target(node, kubelet, daemon, channel, channel_target)
            finally:
                daemon.close()
                print(f"--- daemon {daemon.pid}\n{daemon.log_text()}")
    finally:
        node.remove()


@pytest.fixture(autouse=True)
def _daemon_unharmed(target: Target) -> Iterator[None]:
    """After each test: still running, no traceback, kubelet's stream never dropped."""
    yield
    assert target.daemon.proc.poll() is None
    log = target.daemon.log_text()
    assert "Traceback" not in log
    # Logged at every verbosity, with a traceback, when a handler or connection meets a bug.
    assert "failed unexpectedly" not in log
    assert target.kubelet.stream_open(RESOURCE)
    assert target.kubelet.register_calls == 1


def call_unary(target: Target, method: str, payload: bytes) -> tuple[grpc.StatusCode, Any]:
    """The status, and the decoded answer when OK (grpcio's protobuf must parse it)."""
    try:
        answer = target.channel.unary_unary(
            method, request_serializer=_as_is, response_deserializer=_as_is
        )(payload, timeout=CALL_TIMEOUT)
    except grpc.RpcError as failure:
        code: grpc.StatusCode = failure.code()
        return code, failure.details()
    return OK, RESPONSE_TYPES[method].FromString(answer)


def first_list(target: Target, payload: bytes) -> tuple[grpc.StatusCode, Any]:
    """Open ListAndWatch with `payload` as the request; the first message, then hang up."""
    call = target.channel.unary_stream(
        LIST_AND_WATCH, request_serializer=_as_is, response_deserializer=_as_is
    )(payload, timeout=CALL_TIMEOUT)
    try:
        return OK, pb.ListAndWatchResponse.FromString(next(call))
    except grpc.RpcError as failure:
        code: grpc.StatusCode = failure.code()
        return code, failure.details()
    finally:
        call.cancel()


async def unary(target: Target, method: str, payload: bytes) -> tuple[grpc.StatusCode, Any]:
    with trio.fail_after(CALL_TIMEOUT + 10):
        code, answer = await run_blocking(call_unary, target, method, payload)
    assert target.daemon.proc.poll() is None
    exhausted = {grpc.StatusCode.RESOURCE_EXHAUSTED}
    too_large = exhausted if len(payload) > DEFAULT.message_bytes else set()
    assert code in WELL_FORMED | too_large, (method, payload[:200], code, answer)
    return code, answer


# Protobuf wire format, written by hand so that it can be wrong


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        if value:
            out.append(low | 0x80)
        else:
            out.append(low)
            return bytes(out)


def tag(field: int, wire_type: int) -> bytes:
    return varint(field << 3 | wire_type)


def length_delimited(field: int, payload: bytes) -> bytes:
    return tag(field, 2) + varint(len(payload)) + payload


def repeated_strings(field: int, values: Sequence[bytes]) -> bytes:
    return b"".join(length_delimited(field, value) for value in values)


field_numbers = st.one_of(st.integers(1, 5), st.integers(0, (1 << 29) - 1))


@st.composite
def wire_field(draw: st.DrawFn, payloads: st.SearchStrategy[bytes]) -> bytes:
    """One field of any wire type, including deprecated groups and invalid types 6 and 7."""
    field = draw(field_numbers)
    wire_type = draw(st.integers(0, 7))
    if wire_type == 0:
        return tag(field, 0) + varint(draw(st.integers(-(1 << 63), (1 << 64) - 1)))
    if wire_type == 1:
        return tag(field, 1) + draw(st.binary(min_size=8, max_size=8))
    if wire_type == 2:
        return length_delimited(field, draw(payloads))
    if wire_type == 5:
        return tag(field, 5) + draw(st.binary(min_size=4, max_size=4))
    return tag(field, wire_type) + draw(st.binary(max_size=4))


wire_messages: st.SearchStrategy[bytes] = st.recursive(
    st.lists(wire_field(st.binary(max_size=64)), max_size=4).map(b"".join),
    lambda nested: st.lists(wire_field(st.one_of(nested, st.binary(max_size=64))), max_size=4).map(
        b"".join
    ),
    max_leaves=12,
)

# Device IDs as they go on the wire, each tagged with its kind for the expected answer.
KNOWN, UNKNOWN, EMPTY, HUGE, NOT_UTF8 = "known", "unknown", "empty", "huge", "not utf-8"
_IDS_OF_KIND: dict[str, st.SearchStrategy[bytes]] = {
    KNOWN: st.sampled_from(KNOWN_IDS).map(str.encode),
    UNKNOWN: st.text(min_size=1, max_size=30)
    .filter(lambda text: text not in KNOWN_IDS)
    .map(str.encode),
    EMPTY: st.just(b""),
    # Bytes never valid in UTF-8 wherever they stand (0xff, 0xfe, 0xc0, 0xf8, an encoded
    # surrogate), between arbitrary bytes.
    NOT_UTF8: st.tuples(
        st.binary(max_size=6),
        st.sampled_from([b"\xff", b"\xfe", b"\xc0\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]),
        st.binary(max_size=6),
    ).map(b"".join),
    # Huge for a device ID (kubelet's are at most 63 characters); the error details quote
    # unknown IDs shortened, so even these answer at once.
    HUGE: st.integers(64, 200_000).map(lambda size: b"p" * size),
}


def _ids_of(kinds: list[str]) -> st.SearchStrategy[tuple[str, bytes]]:
    # sampled_from picks kinds about evenly, where one_of would favour its first branch.
    return st.sampled_from(kinds).flatmap(
        lambda kind: _IDS_OF_KIND[kind].map(lambda value: (kind, value))
    )


known_ids = _ids_of([KNOWN])
small_device_ids = _ids_of([KNOWN, UNKNOWN, EMPTY, NOT_UTF8])
device_ids = _ids_of([KNOWN, UNKNOWN, EMPTY, NOT_UTF8, HUGE])
# Unknown fields a conforming parser skips: numbers beyond the message's own, valid wire types.
unknown_fields = st.lists(
    st.one_of(
        st.tuples(st.integers(6, 1000), st.integers(0, 1 << 40)).map(
            lambda pair: tag(pair[0], 0) + varint(pair[1])
        ),
        st.tuples(st.integers(6, 1000), st.binary(max_size=32)).map(
            lambda pair: length_delimited(pair[0], pair[1])
        ),
    ),
    max_size=2,
).map(b"".join)


@attrs.frozen
class Container:
    """One container request: tagged device IDs and unknown fields, and its encoding."""

    ids: tuple[tuple[str, bytes], ...]
    extra: bytes

    def encode(self, field: int = 1) -> bytes:
        return repeated_strings(field, [value for _, value in self.ids]) + self.extra

    @property
    def kinds(self) -> set[str]:
        return {kind for kind, _ in self.ids}

    @property
    def has_duplicates(self) -> bool:
        values = [value for _, value in self.ids]
        return len(set(values)) != len(values)


known_containers = st.builds(
    Container, st.lists(known_ids, min_size=1, max_size=6).map(tuple), unknown_fields
)
any_containers = st.builds(Container, st.lists(device_ids, max_size=6).map(tuple), unknown_fields)
small_containers = st.builds(
    Container, st.lists(small_device_ids, max_size=6).map(tuple), unknown_fields
)
containers = st.one_of(known_containers, any_containers)


def _container_lists(kind: str) -> st.SearchStrategy[list[Container]]:
    if kind == "valid":
        return st.lists(known_containers, min_size=1, max_size=5)
    if kind == "thousands":
        one = st.one_of(known_containers, small_containers)
        return st.tuples(one, st.sampled_from([1_000, 2_500])).map(lambda pair: [pair[0]] * pair[1])
    return st.lists(st.one_of(known_containers, any_containers, any_containers), max_size=5)


# A few valid ones, a few of any kind, or (one time in ten: they are slow) one repeated
# thousands of times. Kubelet itself always sends exactly one.
container_lists = st.sampled_from(["valid"] * 4 + ["any"] * 5 + ["thousands"]).flatmap(
    _container_lists
)


# The tests


@PROFILE
@given(payload=st.one_of(st.binary(max_size=2048), wire_messages))
async def test_arbitrary_bytes_to_every_method(target: Target, payload: bytes) -> None:
    for method in UNARY_METHODS:
        await unary(target, method, payload)
    with trio.fail_after(CALL_TIMEOUT + 10):
        code, answer = await run_blocking(first_list, target, payload)
    assert code in (OK, INVALID), (payload[:200], code, answer)
    if code == OK:
        assert len(answer.devices) == 16


@PROFILE
@given(requests=container_lists, extra=unknown_fields)
async def test_allocate_requests(target: Target, requests: list[Container], extra: bytes) -> None:
    payload = b"".join(length_delimited(1, container.encode()) for container in requests) + extra
    code, answer = await unary(target, ALLOCATE, payload)
    kinds = set().union(*(container.kinds for container in requests))
    event(f"{'thousands of' if len(requests) >= 1000 else 'a few'} container requests")
    event(f"{code.name}: {', '.join(sorted(kinds)) or 'no IDs'}")
    valid = (
        bool(requests)
        and all(container.ids for container in requests)
        and kinds == {KNOWN}
        # As many IDs as the resource advertises at most, in at most 128 container requests.
        and sum(len(container.ids) for container in requests) <= len(KNOWN_IDS)
        and len(requests) <= DEFAULT.container_requests
    )
    duplicates = any(container.has_duplicates for container in requests)
    if len(payload) > DEFAULT.message_bytes:
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, answer)
    elif not valid:
        assert code == INVALID, (code, answer)
    elif not duplicates:
        assert code == OK, (code, answer)
    if code == OK:
        assert len(answer.container_responses) == len(requests)
        for response in answer.container_responses:
            assert [device.container_path for device in response.devices] == ["/dev/sev-guest"]


@PROFILE
@given(
    requests=container_lists,
    must_include=st.lists(device_ids, max_size=3),
    size=st.integers(-(1 << 31), (1 << 31) - 1),
    extra=unknown_fields,
)
async def test_preferred_allocation_requests(
    target: Target,
    requests: list[Container],
    must_include: list[tuple[str, bytes]],
    size: int,
    extra: bytes,
) -> None:
    """Not offered (every share is the same device): UNIMPLEMENTED for any message, whatever
    its fields hold, which the plugin never reads; INVALID_ARGUMENT for bytes that are not a
    message (the same cut short by a byte: its last field then claims more than follows)."""
    body = repeated_strings(2, [value for _, value in must_include]) + tag(3, 0) + varint(size)
    payload = (
        b"".join(length_delimited(1, container.encode() + body) for container in requests) + extra
    )
    code, answer = await unary(target, GET_PREFERRED_ALLOCATION, payload)
    if len(payload) > DEFAULT.message_bytes:  # the deep profile's largest examples
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, answer)
        return
    assert code == UNIMPLEMENTED, (code, answer)
    if payload:
        code, answer = await unary(target, GET_PREFERRED_ALLOCATION, payload[:-1])
        assert code == INVALID, (code, answer)


@PROFILE
@given(container=containers)
async def test_pre_start_container_requests(target: Target, container: Container) -> None:
    code, answer = await unary(target, PRE_START_CONTAINER, container.encode())
    if not container.ids or container.kinds != {KNOWN}:
        assert code == INVALID, (code, answer)
    elif not container.has_duplicates:
        assert code == OK, (code, answer)


async def test_a_4_mib_request_of_unknown_fields_is_read_and_answered(target: Target) -> None:
    """gRPC's limit, kubelet's too: 4 MiB is read and answered, a byte more is refused."""
    head = length_delimited(1, length_delimited(1, b"pcc-7"))
    # Field 7's tag takes 1 byte and its length (about 4 MiB) a 4-byte varint.
    padding = length_delimited(7, b"\0" * (DEFAULT.message_bytes - len(head) - 5))
    request = head + padding
    assert len(request) == DEFAULT.message_bytes
    code, answer = await unary(target, ALLOCATE, request)
    assert code == OK, answer
    assert len(answer.container_responses) == 1
    code, answer = await unary(target, ALLOCATE, request + b"\0")
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert answer == (
        f"a message of {DEFAULT.message_bytes + 1} bytes is larger than the "
        f"{DEFAULT.message_bytes} accepted"
    )


async def test_error_details_stay_short_with_a_huge_unknown_id(target: Target) -> None:
    def allocate_from_a_default_client() -> tuple[grpc.StatusCode, str]:
        options = [("grpc.default_authority", "localhost")]
        request = length_delimited(1, length_delimited(1, b"p" * 100_000))
        with grpc.insecure_channel(target.channel_target, options) as default_client:
            try:
                default_client.unary_unary(
                    ALLOCATE, request_serializer=_as_is, response_deserializer=_as_is
                )(request, timeout=CALL_TIMEOUT)
            except grpc.RpcError as failure:
                return failure.code(), failure.details() or ""
        return OK, ""

    with trio.fail_after(CALL_TIMEOUT + 10):
        code, details = await run_blocking(allocate_from_a_default_client)
    assert code == INVALID, details[:200]
    assert len(details) <= 1024
