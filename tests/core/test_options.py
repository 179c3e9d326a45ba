"""tierkv.options: the one string-to-typed-option conversion of server, tier and connector
options."""

from __future__ import annotations

import os

import msgspec
import pytest

from tierkv.options import OptionError, Size, as_kwargs, convert, signature_struct


class Opts(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str
    size: Size = 0
    flag: bool = False
    count: int = 1
    ratio: float = 0.5
    limit: int | None = None


def test_strings_become_the_field_types() -> None:
    got = convert(
        {
            "name": "x",
            "size": "2MiB",
            "flag": "on",
            "count": " 7 ",
            "ratio": "0.25",
            "limit": "none",
        },
        Opts,
        what="t",
    )
    assert got == Opts(name="x", size=2 * 2**20, flag=True, count=7, ratio=0.25, limit=None)
    for text, value in (("yes", True), ("1", True), ("off", False), ("FALSE", False)):
        assert convert({"name": "x", "flag": text}, Opts, what="t").flag is value


def test_typed_values_are_checked_not_rewritten() -> None:
    assert convert({"name": "x", "size": 4096, "flag": True}, Opts, what="t").size == 4096
    with pytest.raises(OptionError, match="size"):
        convert({"name": "x", "size": -1}, Opts, what="t")


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"name": "x", "size": "lots"}, "t: size='lots': not a size"),
        ({"name": "x", "flag": "maybe"}, "t: flag='maybe': expected true/false"),
        ({"name": "x", "count": "many"}, "t: count='many': expected int"),
        ({"name": "x", "colour": "red"}, "t: unknown option 'colour'; known: count, flag,"),
        ({}, "t: missing required option 'name'"),
    ],
)
def test_errors_name_the_option_and_the_value(values: dict[str, object], message: str) -> None:
    with pytest.raises(OptionError) as exc:
        convert(values, Opts, what="t")
    assert str(exc.value).startswith(message), str(exc.value)


def test_a_factory_signature_is_its_option_struct() -> None:
    def factory(*, path: str | os.PathLike[str], capacity: Size = 10, fsync: bool = False) -> None:
        pass

    struct = signature_struct(factory, "f_options")
    opts = as_kwargs(convert({"path": "/d", "capacity": "1KiB", "fsync": "yes"}, struct, what="f"))
    assert opts == {"path": "/d", "capacity": 1024, "fsync": True}
    with pytest.raises(OptionError, match="missing required option 'path'"):
        convert({}, struct, what="f")
