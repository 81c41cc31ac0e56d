"""Fixtures of the injection tests."""

import logging

import pytest


@pytest.fixture
def quiet_eos_warning():
    """Silence transformers' warning, once per call, that eos_token_id=-1 is not a token: the
    continuous-batching tests pass it on purpose, so that every request runs to
    max_new_tokens."""
    logger = logging.getLogger("transformers.generation.configuration_utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)
