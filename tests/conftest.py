import logging
import os

import pytest

# Tests run several ranks on two cores: keep each process to its share of threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def infinity_logs(caplog):
    """The infinity logger does not propagate; hang pytest's capture handler on it directly."""
    logger = logging.getLogger("infinity")
    logger.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="infinity")
    yield caplog
    logger.removeHandler(caplog.handler)
