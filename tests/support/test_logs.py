"""``tests/support/logs.py``: what a logger logged, from any thread, and nothing after."""

import logging
import threading

from tests.support.logs import logged


def test_logged_keeps_what_the_logger_logs_at_its_level_from_any_thread():
    log = logging.getLogger("tests.support.test_logs.a")
    with logged(log.name) as got:
        log.info("below the level")
        log.warning("from the test %d", 1)
        t = threading.Thread(target=log.error, args=("from a thread",))
        t.start()
        t.join(10)
    log.warning("after the block")
    assert got == ["from the test 1", "from a thread"]
    assert log.handlers == [] and log.level == logging.NOTSET


def test_logged_lowers_a_logger_set_above_the_level_and_restores_it():
    log = logging.getLogger("tests.support.test_logs.b")
    log.setLevel(logging.ERROR)
    with logged(log.name, logging.WARNING) as got:
        log.warning("seen")
    assert got == ["seen"] and log.level == logging.ERROR
