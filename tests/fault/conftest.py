"""What every fault test shares."""

from __future__ import annotations

import pytest

from tests.fault.test_faults import Service


@pytest.fixture(autouse=True)
def no_service_outlives_its_test():
    yield
    Service.stop_leftovers()
