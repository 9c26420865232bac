"""Typed JSON: a JSON value checked against a type annotation and converted, once, where it arrives.

``from_json(cls, obj)`` builds a dataclass, ``decode_as(tp, value)`` any annotated value. Every reader of the
protocol decodes with these rules: unknown keys are ignored (a field added on one side never breaks the other),
a missing required key or a value of the wrong type is a ProtocolError naming the field's path; an int passes
for a float, a bool never for a number. A union of dataclasses that carry a ``KIND`` (the engine events) is
chosen by the value's ``kind``. The decoders know no dataclass by name: the rooms above hand them their types.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Callable
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar, Union

from engine.protocol.wire import ProtocolError

T = TypeVar("T")


def from_json(cls: type[T], obj: Any, where: str | None = None) -> T:
    """A dataclass from a JSON object, every field checked against its annotation (ints pass as floats)."""
    try:
        decoded: T = _decoder(cls)(obj)
    except _Mismatch as exc:
        raise ProtocolError(f"{where or cls.__name__}{exc.path}: {exc.what}") from None
    return decoded


def decode_as(tp: Any, value: Any, where: str = "value") -> Any:
    """One JSON value checked against the annotation ``tp`` and converted (an int passes for a float, a bool never
    for a number); raises ProtocolError naming ``where`` and the path inside it. The typed-JSON decoder of every
    reader of the protocol, for one value at a time."""
    try:
        return _decoder(tp)(value)
    except _Mismatch as exc:
        raise ProtocolError(f"{where}{exc.path}: {exc.what}") from None


# A decoder per annotation, built once: it checks and converts one JSON value. The path to a bad value is
# assembled only on the way out of a failure, so a valid event costs a few dict look-ups per field.

Decoder = Callable[[Any], Any]


class _Mismatch(Exception):
    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path = ""

    def under(self, step: str) -> _Mismatch:
        self.path = step + self.path
        return self


_DECODERS: dict[Any, Decoder] = {}


def _decoder(tp: Any) -> Decoder:
    found = _DECODERS.get(tp)
    if found is None:
        found = _DECODERS[tp] = _build(tp)
    return found


def _got(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _exact(kind: type[Any], expected: str) -> Decoder:
    def decode(value: Any) -> Any:
        if type(value) is kind:  # exact type: a bool is not an int here
            return value
        raise _Mismatch(f"expected {expected}, got {_got(value)}")

    return decode


def _number(value: Any) -> float:
    if type(value) is float:
        return value
    if type(value) is int:
        return float(value)
    raise _Mismatch(f"expected a number, got {_got(value)}")


def _null(value: Any) -> None:
    if value is not None:
        raise _Mismatch(f"expected null, got {_got(value)}")


def _build(tp: Any) -> Decoder:
    if tp is Any:
        return lambda value: value
    if tp is type(None):
        return _null
    simple = {bool: _exact(bool, "true/false"), int: _exact(int, "an integer"), str: _exact(str, "a string")}
    if tp in simple:
        return simple[tp]
    if tp is float:
        return _number
    origin = typing.get_origin(tp)
    if origin is Union or origin is types.UnionType:
        return _union(typing.get_args(tp))
    if origin is list:
        return _list(_decoder(typing.get_args(tp)[0]))
    if origin is dict:
        return _dict(_decoder(typing.get_args(tp)[1]))
    if isinstance(tp, type) and is_dataclass(tp):
        return _dataclass(tp)
    raise TypeError(f"no decoder for {tp!r}")  # a field annotated with a type this module does not map


def _union(args: tuple[Any, ...]) -> Decoder:
    options = [a for a in args if a is not type(None)]
    nullable = len(options) < len(args)
    tagged = {a.KIND: _decoder(a) for a in options if isinstance(a, type) and is_dataclass(a) and hasattr(a, "KIND")}
    if tagged:  # engine events: chosen by their kind

        def by_kind(value: Any) -> Any:
            if value is None and nullable:
                return None
            kind = value.get("kind") if type(value) is dict else None
            decode = tagged.get(kind) if isinstance(kind, str) else None
            if decode is None:
                raise _Mismatch(f"unknown engine event kind {kind!r}")
            try:
                return decode(value)
            except _Mismatch as exc:
                raise exc.under(f" ({kind})") from None

        return by_kind
    decoders = [_decoder(a) for a in options]
    if len(decoders) == 1:
        (only,) = decoders

        def optional(value: Any) -> Any:
            return None if value is None else only(value)

        return optional if nullable else only

    def first_fit(value: Any) -> Any:
        if value is None and nullable:
            return None
        for decode in decoders:
            try:
                return decode(value)
            except _Mismatch:
                continue
        raise _Mismatch(f"{_got(value)} fits none of its types")

    return first_fit


def _list(item: Decoder) -> Decoder:
    def decode(value: Any) -> list[Any]:
        if type(value) is not list:
            raise _Mismatch(f"expected a list, got {_got(value)}")
        out = []
        for i, v in enumerate(value):
            try:
                out.append(item(v))
            except _Mismatch as exc:
                raise exc.under(f"[{i}]") from None
        return out

    return decode


def _dict(item: Decoder) -> Decoder:
    def decode(value: Any) -> dict[str, Any]:
        if type(value) is not dict:
            raise _Mismatch(f"expected an object, got {_got(value)}")
        out = {}
        for k, v in value.items():
            try:
                out[str(k)] = item(v)
            except _Mismatch as exc:
                raise exc.under(f".{k}") from None
        return out

    return decode


def _dataclass(cls: type[Any]) -> Decoder:
    hints = typing.get_type_hints(cls)
    spec = [
        (f.name, _decoder(hints[f.name]), f.default is MISSING and f.default_factory is MISSING) for f in fields(cls)
    ]

    def decode(value: Any) -> Any:
        if type(value) is not dict:
            raise _Mismatch(f"expected an object, got {_got(value)}")
        kwargs = {}
        for name, field_decoder, required in spec:
            if name in value:
                try:
                    kwargs[name] = field_decoder(value[name])
                except _Mismatch as exc:
                    raise exc.under(f".{name}") from None
            elif required:
                raise _Mismatch(f"no {name!r}")
        return cls(**kwargs)

    return decode
