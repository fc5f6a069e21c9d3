"""The policy service tests run the tiny policy of tests/conftest.py on one thread."""

import pytest


@pytest.fixture(scope="package", autouse=True)
def one_thread_for_policy_tests():
    from tests.conftest import single_thread

    with single_thread():
        yield


@pytest.fixture(scope="session")
def tiny_engine(tiny_policy):
    from services.policy.engine import TransformersEngine

    return TransformersEngine(tiny_policy[0], max_batch_size=16)
