"""The app with the real default model, in process (no network)."""

import pytest
from litestar.testing import TestClient

from deltafin.app import build_app


@pytest.fixture(scope="module")
def client(config, services):
    with TestClient(build_app(config, services)) as client:
        yield client
