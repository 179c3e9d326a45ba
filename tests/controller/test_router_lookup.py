"""``POST /lookup`` for routers, with real processes: the controller's answer and every
ring-mode server's agree with what each server's pool really holds; bad bodies are refused
with a clear status and message."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from support.clusterkit import TOKEN, Node, converged, start_node, wait_for
from support.clusterkit import status as node_status
from support.controllers import ControllerProcess, running_controller, start_server
from support.httputil import declare_huge_body, free_port, request
from support.kvops import fetch, held_locally, store, tokens_for
from support.servers import ServerProcess, register

pytestmark = pytest.mark.processes
Factory = Callable[..., ServerProcess]
AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def lookup(url: str, body: object, headers: dict[str, str] = AUTH) -> tuple[int, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = request("POST", f"{url}/lookup", raw, headers)
    return reply.status, reply.json()


def truth(nodes: list[Node], keys: list[bytes]) -> dict[str, int]:
    """Leading chunks each node's pool holds (nodes holding none left out)."""
    out: dict[str, int] = {}
    for node in nodes:
        held = held_locally(node, keys)
        run = held.index(False) if False in held else len(held)
        if run:
            out[node.node_id] = run
    return out


def rebalances(node: Node) -> int:
    return int(node_status(node)["directory"]["rebalances"])


def runs(answer: dict[str, Any]) -> dict[str, int]:
    return {row["instance"]: row["chunks"] for row in answer.get("instances", [])}


def a_holds_four_b_two(a: Node, b: Node) -> tuple[list[int], list[bytes]]:
    tokens = tokens_for(7, 4)
    keys = store(a, tokens, 4)
    assert fetch(b, tokens[: 2 * 256], 2) == (2, [0, 1])  # B copies the first two
    return tokens, keys


@pytest.fixture
def controller(tmp_path: Path) -> Iterator[ControllerProcess]:
    with running_controller(tmp_path, http_port=free_port()) as ctl:
        yield ctl


def test_controller_lookup_agrees_with_what_each_server_holds(
    server_factory: Factory, controller: ControllerProcess
) -> None:
    nodes = [start_server(server_factory, controller.addr) for _ in range(3)]
    a, b, _ = nodes
    wait_for(lambda: len(controller.instances()) == 3)
    tokens, keys = a_holds_four_b_two(a, b)
    want = truth(nodes, keys)
    assert want == {a.node_id: 4, b.node_id: 2}
    url = f"http://127.0.0.1:{controller.http_port}"
    digest = keys[0][:16].hex()
    with a.client() as engine:  # an engine of the model is registered (on A)
        register(engine)
        by_model = {"model": "test-model", "tokens": [*tokens, 1, 2, 3]}  # + a partial chunk
        wait_for(lambda: runs(lookup(url, by_model)[1]) == want)
        status, answer = lookup(url, by_model)
    assert status == 200 and answer["chunks"] == 4
    assert answer["instances"][0] == {
        "instance": a.node_id, "address": f"127.0.0.1:{a.port + 1}", "namespace": digest,
        "model": "test-model", "chunks": 4, "tokens": 1024, "tiers": {"pool": 4, "disk": 0},
    }  # fmt: skip
    assert answer["instances"][1]["tokens"] == 512
    # The engine has unregistered; its server tells the controller from a sender thread.
    wait_for(lambda: all(not i["namespaces"] for i in controller.instances().values()))
    # By namespace and the chunks' hashes (no engine needed): the same holders, and their
    # tokens (the controller remembers the namespace while its chunks are held).
    by_hash = {"namespace": digest, "hashes": [k[16:].hex() for k in keys]}
    status, answer = lookup(url, by_hash)
    assert status == 200 and runs(answer) == want
    assert [row["tokens"] for row in answer["instances"]] == [1024, 512]
    # By model, with no engine of it registered anywhere: the chunks held still answer.
    status, answer = lookup(url, by_model)
    assert status == 200 and runs(answer) == want, answer
    # Gone from every pool, the namespace is forgotten.
    for node in nodes:
        with node.client() as client:
            client.clear(everything=True)
    wait_for(lambda: lookup(url, by_model)[0] == 404)
    assert "no engine of model 'test-model'" in lookup(url, by_model)[1]["error"]


def test_every_ring_server_answers_the_same_lookup(server_factory: Factory) -> None:
    ports = [free_port() for _ in range(3)]
    a = start_node(server_factory, [], seed_self=True, extra=["--http-port", str(ports[0])])
    rest = [
        start_node(server_factory, [a.port], seed_self=True, extra=["--http-port", str(p)])
        for p in ports[1:]
    ]
    nodes = [a, *rest]
    b, c = rest
    wait_for(lambda: converged(nodes))
    tokens, keys = a_holds_four_b_two(a, b)
    want = truth(nodes, keys)
    assert want == {a.node_id: 4, b.node_id: 2}
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    digest = keys[0][:16].hex()
    by_hash = {"namespace": digest, "hashes": [k[16:].hex() for k in keys]}
    for url in urls:
        wait_for(lambda url=url: runs(lookup(url, by_hash)[1]) == want)
    # By model, on a server where an engine of the model is registered.
    with b.client() as engine:
        register(engine)
        status, answer = lookup(urls[1], {"model": "test-model", "tokens": tokens})
    assert status == 200 and runs(answer) == want
    assert {r["instance"]: r["tokens"] for r in answer["instances"]} == {
        a.node_id: 1024,
        b.node_id: 512,
    }
    # Every engine has left (A's stored, B's fetched, C's only looked up): each server
    # remembers the model's namespaces while chunks of them are held or for a while after
    # its last engine left, and answers by model, after a membership change too (D joins:
    # every node re-publishes what it holds, and forgets what it neither holds nor had lately).
    before = rebalances(c)
    d = start_node(server_factory, [a.port], seed_self=True)
    wait_for(lambda: converged([*nodes, d]) and rebalances(c) > before)
    by_model = {"model": "test-model", "tokens": tokens}
    for url in urls:
        status, answer = lookup(url, by_model)
        assert status == 200 and runs(answer) == want, (url, answer)
        assert {r["tokens"] for r in answer["instances"]} == {1024, 512}
    status, answer = lookup(urls[2], {"model": "other-model", "tokens": tokens})
    assert status == 404 and "no engine of model 'other-model'" in answer["error"], answer
    # A namespace no engine of this server had: by namespace, with the tokens per chunk.
    status, answer = lookup(urls[2], {"namespace": "cd" * 16, "tokens": tokens})
    assert status == 404 and "chunk_tokens" in answer["error"]
    body = {"namespace": digest, "tokens": tokens, "chunk_tokens": 256}
    status, answer = lookup(urls[2], body)
    assert status == 200 and runs(answer) == want
    assert lookup(urls[2], body, headers={})[0] == 401  # authorized like every POST
    assert c.node_id not in runs(answer)


NS = "ab" * 16


BAD_BODIES: list[tuple[object, int, str]] = [
    (b"{not json", 400, "not JSON"),
    ({}, 400, "exactly one of model or namespace"),
    ({"model": "m", "namespace": NS, "tokens": [1]}, 400, "exactly one of model"),
    ({"model": "m"}, 400, "exactly one of tokens or hashes"),
    ({"model": "m", "tokens": [1], "hashes": []}, 400, "exactly one of tokens or hashes"),
    ({"namespace": "zz" * 16, "hashes": []}, 400, "32 hex digits"),
    ({"namespace": NS[:30], "hashes": []}, 400, "32 hex digits"),
    ({"namespace": NS[:30] + "  ", "hashes": []}, 400, "32 hex digits"),
    ({"namespace": NS, "hashes": [" ab"]}, 400, "hex strings"),
    ({"model": "m", "tokens": [-1]}, 400, "0 <= id < 2**32"),
    ({"model": "m", "tokens": [2**32]}, 400, "0 <= id < 2**32"),
    ({"model": "m", "tokens": "abc"}, 400, "Expected `array | null`, got `str`"),
    ({"model": "m", "tokens": [1], "extra": 1}, 400, "unknown field"),
    ({"namespace": NS, "hashes": ["xyz"]}, 400, "hex strings"),
    ({"namespace": NS, "hashes": [""]}, 400, "hex strings"),
    ({"model": "m", "tokens": [1], "chunk_tokens": 4}, 400, "comes with a namespace"),
    ({"namespace": NS, "tokens": [1], "chunk_tokens": -4}, 400, "chunk_tokens must be 1.."),
    ({"namespace": NS, "tokens": [1], "chunk_tokens": 2**61}, 400, "chunk_tokens must be 1.."),
    ({"namespace": NS, "tokens": [1] * 9, "chunk_tokens": 2**63}, 400, "chunk_tokens must be"),
    ({"namespace": NS, "hashes": ["00"], "chunk_tokens": 2**62}, 400, "chunk_tokens must be"),
    ({"namespace": NS, "tokens": [1], "chunk_tokens": 2**64}, 400, "chunk_tokens"),
    ({"model": "nobody", "tokens": [1]}, 404, "no engine of model 'nobody'"),
    ({"namespace": NS, "tokens": [1]}, 404, "not registered here"),
]


def refuses_bad_bodies(url: str) -> None:
    for body, status, reason in BAD_BODIES:
        got, answer = lookup(url, body)
        assert got == status and reason in answer["error"], (body, answer)
    got, answer = declare_huge_body(url, "POST", "/lookup", AUTH)
    assert got == 413 and "larger than" in answer["error"], answer
    # It keeps answering.
    assert lookup(url, {"namespace": NS, "hashes": ["00"]}) == (200, {"chunks": 1, "instances": []})


def test_bad_lookup_bodies_are_refused_with_a_reason(controller: ControllerProcess) -> None:
    url = f"http://127.0.0.1:{controller.http_port}"
    refuses_bad_bodies(url)
    status, answer = declare_huge_body(url, "POST", "/instances/remove", AUTH)
    assert status == 413 and "larger than" in answer["error"]
    assert "Traceback" not in controller.log() and " ERROR " not in controller.log()


def test_a_ring_server_refuses_bad_lookups_like_the_controller(server_factory: Factory) -> None:
    port = free_port()
    node = start_node(server_factory, [], seed_self=True, extra=["--http-port", str(port)])
    refuses_bad_bodies(f"http://127.0.0.1:{port}")
    text = node.server.log()
    assert "Traceback" not in text and " ERROR " not in text, text[-2000:]


def test_lookup_needs_the_token(controller: ControllerProcess) -> None:
    url = f"http://127.0.0.1:{controller.http_port}"
    body = {"namespace": NS, "hashes": ["00"]}
    assert lookup(url, body, headers={})[0] == 401
    assert lookup(url, body, headers={"Authorization": "Bearer wrong"})[0] == 403


def test_a_model_is_found_by_the_name_its_engines_serve_it_under(server_factory: Factory) -> None:
    """The vLLM and SGLang connectors register a model's namespace as ``MODEL|kv=FORMAT``
    (what the chunk bytes mean): a router names the model as the engines serve it, and
    ``POST /lookup`` finds its namespaces by that name (and by the whole registered one);
    another model, or a name that only starts the same, is not found."""
    from support.servers import chunk_data

    port = free_port()
    node = start_node(server_factory, [], seed_self=True, extra=["--http-port", str(port)])
    url = f"http://127.0.0.1:{port}"
    tokens = tokens_for(11, 3)
    registered = "org/model-7b|kv=native:CPU_ATTN/vec:bs128:kb128"
    with node.server.client(auth_token=TOKEN) as c:
        register(c, registered)
        c.store(tokens, [chunk_data(tokens, i) for i in range(3)])
    for name in ("org/model-7b", registered):
        status, answer = lookup(url, {"model": name, "tokens": tokens})
        assert status == 200, answer
        (row,) = answer["instances"]
        assert row["chunks"] == 3 and row["tokens"] == 3 * 256 and row["model"] == registered
    for name in ("org/model", "org/model-7b|kv=other", "other"):
        status, answer = lookup(url, {"model": name, "tokens": tokens})
        assert status == 404 and "no engine of model" in answer["error"], (name, answer)
