"""Fixtures for the test suite; the builders live in helpers.py."""

import matplotlib
import pytest
from helpers import make_data, make_model

matplotlib.use("Agg")


@pytest.fixture
def data():
    return make_data()


@pytest.fixture
def model():
    return make_model()
