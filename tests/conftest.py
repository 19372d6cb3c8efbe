"""Shared fixtures (helpers: :mod:`tests.helpers`)."""
from __future__ import annotations

import pytest

from tests.helpers import DEVICES


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
