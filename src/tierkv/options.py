"""Typed options from text: the one conversion behind the server's configuration, the tier
options (``--tier disk:capacity=100GiB,fsync=false``) and the vLLM connector's settings.

Options arrive as strings (flags, environment variables, ``--tier`` specifications) or
already typed (YAML, JSON). :func:`convert` turns a mapping of them into a msgspec struct:
strings become the field's type (``false``/``no``/``off``/``0`` for a bool, ``null`` or
``none`` for an optional value, ``512MiB`` for a :data:`Size`), typed values are checked,
unknown and missing options are refused. Errors name the option and the value.
:func:`signature_struct` derives such a struct from a factory's keyword parameters, so a
tier's constructor signature is the only place its options and their defaults are written.
"""

from __future__ import annotations

import inspect
import re
import typing
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Annotated, Any, TypeVar

import msgspec

T = TypeVar("T", bound=msgspec.Struct)


class OptionError(ValueError):
    """An option is unknown, missing or not a value of its type; the message names it."""


MAX_SIZE = 2**63 - 1  # bytes: what a signed 64-bit count holds (8 EiB); larger is refused
# A byte count that may be written with a unit: 1073741824, 1GiB, 512MiB, 2G (binary), 2GB.
Size = Annotated[int, msgspec.Meta(ge=0, le=MAX_SIZE, extra={"unit": "bytes"})]

_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE | re.ASCII)
_DECIMAL = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_NONE = frozenset({"", "none", "null"})


def parse_size(value: str | int) -> int:
    """Bytes from ``1073741824``, ``1GiB``, ``512MiB``, ``2G`` (binary), ``2GB`` (decimal)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise OptionError(f"not a size: {value!r} (examples: 512MiB, 4GiB, 1073741824)")
    text = str(value).strip()
    shown = text if len(text) <= 24 else f"{text[:20]}..."
    whole, _, fraction = m.group(1).lstrip("0").partition(".")
    if len(whole) > len(str(MAX_SIZE)):  # (and a Fraction of over 4,300 digits raises)
        raise OptionError(f"{shown!r} is more than {MAX_SIZE} bytes (8 EiB)")
    # An exact fraction (a float rounded byte counts past 2**53, and overflowed on long
    # ones). Its digits past the 40th change no whole byte: a unit is at most 2**40 bytes,
    # and a multiple of 2**-40 has at most 40 decimals.
    number = Fraction(f"{whole or 0}.{fraction[:40] or 0}")
    unit = (m.group(2) or "").lower()
    prefix = unit[:1] if unit[:1] in "kmgt" else ""
    binary = "i" in unit or (prefix and not unit.endswith("b"))
    mult = 1024 ** "_kmgt".index(prefix) if (binary and prefix) else _DECIMAL[prefix]
    if mult == 1 and (number.denominator != 1 or fraction.strip("0")):
        raise OptionError(f"not a whole number of bytes: {value!r}")
    size = int(number * mult)  # a fraction of a unit: whole bytes, rounded down
    if size > MAX_SIZE:
        raise OptionError(f"{shown!r} is more than {MAX_SIZE} bytes (8 EiB)")
    return size


def convert(values: Mapping[str, Any], into: type[T], *, what: str) -> T:
    """``values`` as an instance of the struct ``into``; raises :class:`OptionError`
    prefixed with ``what`` (e.g. ``"tier 'disk'"``) for anything it cannot be."""
    info = msgspec.inspect.type_info(into)
    assert isinstance(info, msgspec.inspect.StructType)
    kinds = {f.name: f.type for f in info.fields}
    prepared: dict[str, Any] = {}
    for name, value in values.items():
        kind = kinds.get(name)
        try:
            prepared[name] = value if kind is None else _from_text(value, kind)
        except OptionError as exc:
            raise OptionError(f"{what}: {name}={value!r}: {exc}") from None
    try:
        return msgspec.convert(prepared, into, strict=False)
    except msgspec.ValidationError as exc:
        raise OptionError(f"{what}: {_readable(str(exc), values, kinds)}") from None


def signature_struct(factory: Callable[..., Any], name: str) -> type[msgspec.Struct]:
    """A struct whose fields are ``factory``'s keyword parameters, with their annotations
    and defaults (annotations msgspec cannot check, like ``os.PathLike``, accept any
    value and leave the check to the factory)."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    target = factory.__init__ if inspect.isclass(factory) else factory
    hints = typing.get_type_hints(target, include_extras=True)
    for param in inspect.signature(factory).parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            continue
        kind = _checkable(hints.get(param.name, Any))
        if param.default is param.empty:
            fields.append((param.name, kind))
        else:
            fields.append((param.name, kind, param.default))
    return msgspec.defstruct(name, fields, kw_only=True, forbid_unknown_fields=True)


def as_kwargs(options: msgspec.Struct) -> dict[str, Any]:
    """The fields of a converted options struct, for calling the factory it describes."""
    return msgspec.structs.asdict(options)


# -- internals ---------------------------------------------------------------------------
def _checkable(hint: Any) -> Any:
    """``hint`` if msgspec can check values against it, else ``Any``."""
    try:
        msgspec.inspect.type_info(hint)
    except TypeError:
        return Any
    return hint


def _members(kind: msgspec.inspect.Type) -> tuple[msgspec.inspect.Type, ...]:
    if isinstance(kind, msgspec.inspect.Metadata):
        return _members(kind.type)
    if isinstance(kind, msgspec.inspect.UnionType):
        return tuple(m for t in kind.types for m in _members(t))
    return (kind,)


def _is_size(kind: msgspec.inspect.Type) -> bool:
    if isinstance(kind, msgspec.inspect.Metadata):
        return (kind.extra or {}).get("unit") == "bytes" or _is_size(kind.type)
    if isinstance(kind, msgspec.inspect.UnionType):
        return any(_is_size(t) for t in kind.types)
    return False


def _from_text(value: Any, kind: msgspec.inspect.Type) -> Any:
    """A string ``value`` made the field's type where msgspec's own string conversion is
    narrower than what operators write (units, yes/no, none); other values unchanged."""
    if not isinstance(value, str):
        return value
    members = _members(kind)
    text = value.strip().lower()
    if text in _NONE and any(isinstance(m, msgspec.inspect.NoneType) for m in members):
        return None
    if _is_size(kind):
        return parse_size(value)
    if any(isinstance(m, msgspec.inspect.StrType | msgspec.inspect.AnyType) for m in members):
        return value
    if any(isinstance(m, msgspec.inspect.BoolType) for m in members):
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
        raise OptionError("expected true/false, yes/no, on/off or 1/0")
    return value.strip()


_AT = re.compile(r"^(?P<msg>.*) - at `\$\.(?P<field>\w+)`$", re.DOTALL)
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<field>\w+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<field>\w+)`$")


def _readable(message: str, values: Mapping[str, Any], kinds: Mapping[str, Any]) -> str:
    """msgspec's validation message in the words of options."""
    if m := _UNKNOWN.match(message):
        return f"unknown option {m['field']!r}; known: {', '.join(sorted(kinds))}"
    if m := _MISSING.match(message):
        return f"missing required option {m['field']!r}"
    if m := _AT.match(message):
        field = m["field"]
        detail = m["msg"].replace("`", "")
        detail = detail[:1].lower() + detail[1:]
        return f"{field}={values.get(field)!r}: {detail}"
    return message


__all__ = [
    "MAX_SIZE",
    "OptionError",
    "Size",
    "as_kwargs",
    "convert",
    "parse_size",
    "signature_struct",
]


def option(section: str, help_text: str) -> msgspec.Meta:
    """A configuration field's section of the command line's help and its help text, kept
    next to the field: ``name: Annotated[int, option(POOL, "what it is")] = 1``
    (:func:`tierkv.config.add_arguments` reads them)."""
    return msgspec.Meta(description=help_text, extra={"section": section})


def option_help(kind: msgspec.inspect.Type) -> tuple[str, str]:
    """The (section, help text) :func:`option` gave a field's type ("", "" without)."""
    if isinstance(kind, msgspec.inspect.Metadata):
        extra = kind.extra or {}
        schema = kind.extra_json_schema or {}
        if "section" in extra:
            return str(extra["section"]), str(schema.get("description", ""))
        return option_help(kind.type)
    return "", ""
