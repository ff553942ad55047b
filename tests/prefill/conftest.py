"""Fixtures of the prefill tests."""
import collections

import pytest

from mla_ext.dispatch import Dispatcher


@pytest.fixture
def resolutions(monkeypatch):
    """Counts Dispatcher.decide calls (every backend choice goes through it) per op."""
    count: collections.Counter = collections.Counter()
    real = Dispatcher.decide

    def decide(self, inputs):
        count[self.op] += 1
        return real(self, inputs)

    monkeypatch.setattr(Dispatcher, "decide", decide)
    return count
