"""The conformance suite's fixtures: ``kind`` runs a test once per device kind in ``ARUNTIME_KINDS``."""

from __future__ import annotations

import pytest

from tests.conformance.kinds import KINDS, Kind, open_kind


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> Kind:
    """An opened kind (skipped, with the reason, when it does not open here)."""
    return open_kind(request.param)


@pytest.fixture(params=KINDS)
def other_kind(request: pytest.FixtureRequest) -> Kind:
    """A second kind, for transfers between every pair."""
    return open_kind(request.param)
