"""Fixtures shared by every test directory; helpers live in ``tests/helpers``."""

import json

import pytest

from helpers import LAYOUTS
from helpers.redis_server import RedisServer


def pytest_collection_modifyitems(items):
    """Long tests first, so the xdist workers do not wait on one of them at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture
def seed_layout_dict():
    return json.loads((LAYOUTS / "seed-flash-next.json").read_text())


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server):
    import redis

    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url
