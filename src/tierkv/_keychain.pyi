"""Types of the C helper ``_keychain.c`` (see :func:`tierkv.keys._hash_pieces_python`)."""

def chain(
    prev: bytes,
    data: bytes | bytearray | memoryview,
    start: int,
    stop: int,
    step: int,
    prefix: bytes,
) -> list[bytes]: ...
