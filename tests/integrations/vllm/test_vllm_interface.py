"""The connector against the installed vLLM's connector interface.

Every public method and property of ``KVConnectorBase_V1`` (and of ``SupportsHMA``) is either
implemented by ``TierKVConnector`` or kept at its default on purpose, with a reason
(``interface.KEPT_DEFAULTS``): a vLLM release that adds a hook fails here, before it reaches
an engine. The installed vLLM must be one the connector is tested with.
"""

from __future__ import annotations

import pytest

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from tierkv.integrations.vllm import interface
    from tierkv.integrations.vllm.connector import TierKVConnector
except ImportError:  # the conftest fails every test with the reason
    pass

pytestmark = pytest.mark.vllm


def test_every_hook_of_vllms_base_class_is_implemented_or_kept_on_purpose() -> None:
    bases = interface.connector_bases()
    unlisted, contradicted, stale = interface.interface_gaps(TierKVConnector, bases)
    assert unlisted == [], f"implement these or add them to KEPT_DEFAULTS, with why: {unlisted}"
    assert contradicted == [], f"implemented, yet listed as kept at the default: {contradicted}"
    assert stale == [], f"KEPT_DEFAULTS names what vLLM no longer has: {stale}"
    assert not TierKVConnector.__abstractmethods__
    assert all(reason.strip() for reason in interface.KEPT_DEFAULTS.values())


def test_the_check_finds_a_hook_a_new_vllm_adds() -> None:
    """A base class with one more hook (as the next vLLM may have) is reported, as are a
    kept name the base no longer has and an implemented one listed as kept."""

    class NextBase(KVConnectorBase_V1):  # type: ignore[misc]
        def on_something_new(self) -> None:
            return

        @property
        def new_capability(self) -> bool:
            return False

    class Connector(NextBase):
        def get_finished_count(self) -> int | None:
            return 1

    bases = [*interface.connector_bases(), NextBase]
    kept = {**interface.KEPT_DEFAULTS, "gone_hook": "removed since"}
    unlisted, contradicted, stale = interface.interface_gaps(Connector, bases, kept)
    assert {"on_something_new", "new_capability"} <= set(unlisted)
    assert "get_finished_count" in contradicted
    assert stale == ["gone_hook"]


def test_the_installed_vllm_is_a_version_the_connector_is_tested_with() -> None:
    import vllm

    assert vllm.__version__ in interface.TESTED_VLLM_VERSIONS, (
        f"vLLM {vllm.__version__}: run the vLLM tests, then add it to TESTED_VLLM_VERSIONS"
    )
