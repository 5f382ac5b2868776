"""betterproto2's private parts, used here and nowhere else.

tests/test_library_contracts.py pins what this relies on, so that an upgrade
of betterproto2 fails there and only there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import betterproto2

_PYTHON_TYPES: dict[str, type] = {
    betterproto2.TYPE_STRING: str,
    betterproto2.TYPE_BYTES: bytes,
    betterproto2.TYPE_BOOL: bool,
    betterproto2.TYPE_INT32: int,
    betterproto2.TYPE_INT64: int,
}


def type_problem(message: betterproto2.Message) -> str | None:
    """Which field holds a value of the wrong type, or None.

    betterproto2 decodes a field sent with the wrong wire type into a value of
    the wrong type (an int where a message belongs); the handlers must never
    see one.
    """
    metadata: Any = type(message)._betterproto  # type: ignore[arg-type]
    message_classes: dict[str, type[betterproto2.Message]] = metadata.cls_by_field
    for field in dataclasses.fields(message):  # type: ignore[arg-type]
        meta = betterproto2.FieldMetadata.get(field)
        value = getattr(message, field.name)
        if meta.repeated and not isinstance(value, list):
            return f"field {field.name} is not a list"
        items: list[Any] = value if meta.repeated else [value]
        for item in items:
            if meta.proto_type == betterproto2.TYPE_MESSAGE:
                if item is None and not meta.repeated:
                    continue
                if not isinstance(item, message_classes[field.name]):
                    return f"field {field.name} holds {type(item).__name__}, not a message"
                problem = type_problem(item)
                if problem:
                    return problem
            elif not isinstance(item, _PYTHON_TYPES.get(meta.proto_type, object)):
                return f"field {field.name} holds {type(item).__name__}, not {meta.proto_type}"
    return None
