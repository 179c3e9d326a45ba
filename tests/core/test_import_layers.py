"""tierkv's dependencies point one way: every import in src/tierkv (function-level and
type-checking ones included) goes from a part of the package to a part in a lower layer of
:data:`LAYERS`, so no cycle can form, between modules or between packages.

A new top-level module or subpackage must be placed in :data:`LAYERS`; an import that points
up means that the shared piece belongs lower (see docs/architecture.md)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"

# Lowest first. A part is a top-level module or subpackage of tierkv ("" is the package's
# own __init__); a part may import only parts of lower layers.
LAYERS: list[set[str]] = [
    # foundations: wire formats, memory, threads, logging, options
    {
        "", "_fingerprints", "_keychain", "_piecewise", "_streamcopy", "allocator",
        "checksums", "dtypes", "endpoints", "framing", "gc_pauses", "liveness", "logs",
        "options", "pool", "priority", "protocol", "redaction", "runtime_dir", "thread_names",
        "workers",
    },
    {"arraycopy", "chunk_follower", "copier", "keys", "piecewise_io", "served_connections"},
    {"tenants", "tiers"},  # the storage tiers
    {"config", "index"},  # the server's configuration, the pool's object index
    {"client", "cluster", "eviction"},  # the engines' client; servers among themselves
    {"demo", "integrations", "web"},  # engine integrations, shared HTTP pieces, the demo
    {"controller", "server", "quota_cli"},  # the two processes; quota commands over HTTP
    {"cli", "docs_reference"},  # the command line; the documentation's generated reference
]  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(f): f for f in (SRC / "tierkv").rglob("*.py")}


def imports_of(name: str, path: Path, known: set[str]) -> Iterator[str]:
    """The tierkv modules (or packages) that ``path`` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "tierkv")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "tierkv":
                continue
            for alias in node.names:  # `from tierkv.x import y`: y may be a module
                full = f"{source}.{alias.name}"
                yield full if full in known else source


def part(module: str) -> str:
    """The top-level part of tierkv that ``module`` belongs to."""
    return module.split(".")[1] if "." in module else ""


def layer_of(name: str) -> int:
    for i, layer in enumerate(LAYERS):
        if name in layer:
            return i
    raise AssertionError(f"tierkv.{name} is in no layer: add it to LAYERS in {__file__}")


def test_every_import_points_to_a_lower_layer() -> None:
    mods = modules()
    known = set(mods)
    upward = []
    for name, path in sorted(mods.items()):
        src_part = part(name)
        for target in sorted(set(imports_of(name, path, known))):
            dst_part = part(target)
            if dst_part != src_part and layer_of(dst_part) >= layer_of(src_part):
                upward.append(f"{name} -> {target}")
    assert not upward, "imports that do not point to a lower layer:\n" + "\n".join(upward)


def test_no_import_cycle_between_modules() -> None:
    mods = modules()
    known = set(mods)
    graph = {
        n: {t for t in imports_of(n, p, known) if t in known and t != n} for n, p in mods.items()
    }
    # A package's __init__ imported by its own modules is not a cycle worth reporting
    # unless the __init__ imports them back: the walk below finds exactly such loops.
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*path[path.index(nxt) :], nxt]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_check_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    """The parser finds an import inside a function and a relative one (the ones a cycle
    hides behind)."""
    pkg = tmp_path / "tierkv" / "server"
    pkg.mkdir(parents=True)
    mod = pkg / "thing.py"
    mod.write_text("def f():\n    from tierkv.cli import main\n\nfrom ..client import Client\n")
    known = {"tierkv.cli", "tierkv.client", "tierkv.server.thing"}
    found = set(imports_of("tierkv.server.thing", mod, known))
    assert found == {"tierkv.cli", "tierkv.client"}


def test_importing_the_client_loads_no_server_configuration() -> None:
    """An engine imports the client alone: nothing it imports, transitively, is the
    server's configuration (or the server, the cluster, the tiers)."""
    mods = modules()
    known = set(mods)
    seen: set[str] = set()
    todo = [m for m in mods if m == "tierkv.client" or m.startswith("tierkv.client.")]
    while todo:
        name = todo.pop()
        if name in seen or name not in mods:
            continue
        seen.add(name)
        todo += imports_of(name, mods[name], known)
    loaded = {part(m) for m in seen}
    assert not loaded & {"config", "server", "cluster", "tiers", "controller"}, sorted(loaded)
