"""The gRPC services of the DRA mode: plugin registration, and kubelet's DRAPlugin (v1, v1beta1).

Requests are read by `wire`, which checks each field as it reads it and stops at the first
one past a limit (a malformed or oversized request is INVALID_ARGUMENT, without a traceback).
A call that fails for one claim answers that claim's error and the others' devices: kubelet
fails only the pods of that claim, and tries them again.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from pcc_plugin import cdi, wire
from pcc_plugin._proto import pluginregistration as registration
from pcc_plugin._proto.k8s.io.kubelet.pkg.apis.dra import v1, v1beta1
from pcc_plugin.bridge import call_trio
from pcc_plugin.dra import health
from pcc_plugin.dra.claims import ClaimRef, Preparer
from pcc_plugin.dra.sockets import DRA_V1, DRA_V1BETA1, PLUGIN_TYPE
from pcc_plugin.grpc_server import Call, GRPCError, MethodSpec, Status
from pcc_plugin.klog import V1
from pcc_plugin.limits import Limits
from pcc_plugin.state import ResourceState

log = logging.getLogger(__name__)

REGISTRATION = "/pluginregistration.Registration/"
# What GetInfo offers, preferred first: kubelet takes the first it knows (and, apart, the first
# of the health services, dra/health.py).
SUPPORTED_SERVICES = ["v1.DRAPlugin", "v1beta1.DRAPlugin"]


def registration_methods(
    driver: str, endpoint: str, state: ResourceState, cause: str
) -> dict[str, MethodSpec]:
    """What kubelet asks of the registration socket: who we are, and how registering went."""
    info = bytes(
        registration.PluginInfo(
            type=PLUGIN_TYPE,
            name=driver,
            endpoint=endpoint,
            supported_versions=[*SUPPORTED_SERVICES, *health.SERVICES],
        )
    )

    def get_info(data: bytes, call: Call) -> bytes:
        wire.check_request(data, wire.EMPTY, "InfoRequest")
        # Kubelet asks when it finds the socket; the doctor asks too.
        log.log(V1, "Answered GetInfo on the registration socket")
        return info

    def notify_registration_status(data: bytes, call: Call) -> bytes:
        wire.check_request(data, wire.REGISTRATION_STATUS, "RegistrationStatus")
        status = registration.RegistrationStatus.parse(data)
        if status.plugin_registered:
            state.registered_with_kubelet(cause)
            log.info("Registered DRA driver %s with kubelet", driver)
        else:
            state.registration_refused(status.error)
            log.error("Kubelet refused the registration of DRA driver %s: %s", driver,
                      status.error)  # fmt: skip
        return b""

    return {
        REGISTRATION + "GetInfo": MethodSpec(get_info),
        REGISTRATION + "NotifyRegistrationStatus": MethodSpec(notify_registration_status),
    }


def dra_methods(preparer: Preparer) -> dict[str, MethodSpec]:
    """NodePrepareResources and NodeUnprepareResources, in both versions kubelet may pick."""
    calls = {"NodePrepareResources": prepare, "NodeUnprepareResources": unprepare}
    return {
        service + name: MethodSpec(functools.partial(call, preparer, api))
        for service, api in ((DRA_V1, v1), (DRA_V1BETA1, v1beta1))
        for name, call in calls.items()
    }


async def prepare(preparer: Preparer, api: Any, data: bytes, call: Call) -> bytes:
    claims = read_claims(data, "NodePrepareResourcesRequest", preparer.limits)
    with preparer.state.dra_call("prepare"):
        answers = await call_trio(preparer.prepare, claims)
    return bytes(
        api.NodePrepareResourcesResponse(
            claims={
                uid: api.NodePrepareResourceResponse(error=answer)
                if isinstance(answer, str)
                else api.NodePrepareResourceResponse(
                    devices=[
                        api.Device(
                            request_names=list(device.requests),
                            pool_name=device.pool,
                            device_name=device.device,
                            cdi_device_ids=[cdi.claim_device_id(preparer.driver, uid)],
                        )
                        for device in answer.devices
                    ]
                )
                for uid, answer in answers.items()
            }
        )
    )


async def unprepare(preparer: Preparer, api: Any, data: bytes, call: Call) -> bytes:
    claims = read_claims(data, "NodeUnprepareResourcesRequest", preparer.limits)
    with preparer.state.dra_call("unprepare"):
        answers = await call_trio(preparer.unprepare, claims)
    return bytes(
        api.NodeUnprepareResourcesResponse(
            claims={
                uid: api.NodeUnprepareResourceResponse(error=error or "")
                for uid, error in answers.items()
            }
        )
    )


def read_claims(data: bytes, name: str, limits: Limits) -> list[ClaimRef]:
    """The claims of request `name`, read from the wire as far as the limits allow: a request
    past one costs what its bytes up to there cost (INVALID_ARGUMENT), not all of it."""
    try:
        read = wire.read_claims_request(data, limits.claims, limits.claim_bytes)
        claims = [ClaimRef(claim["namespace"], claim["name"], claim["uid"]) for claim in read]
        if all(claim.uid and claim.namespace and claim.name for claim in claims):
            return claims
        why = f"{name} names a claim without namespace, name or UID"
    except wire.TooManyOthers:
        why = f"{name} has more than {limits.claims} fields besides its claims"
    except wire.TooMany:
        why = f"{name} has more than {limits.claims} claims"
    except wire.TooLong as exc:
        why = (
            f"{name} names a claim of {exc.size} bytes, more than the {limits.claim_bytes} of any "
            "claim kubelet names"
        )
    except wire.WireError as exc:
        why = f"cannot decode {name}: {exc}"
    raise GRPCError(Status.INVALID_ARGUMENT, why)
