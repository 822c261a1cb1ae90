import logging

from kvdepot.log_limiter import LogLimiter


def test_one_line_per_kind_per_interval_with_the_count_of_the_rest(caplog):
    now = [0.0]
    limiter = LogLimiter(logging.getLogger("kvdepot.test"), interval=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvdepot.test"):
        for i in range(1000):
            limiter.warning("junk", "dropped message %d", i)
        limiter.warning("other", "another kind")
        now[0] = 10.5
        limiter.warning("junk", "dropped message %d", 1000)
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["dropped message 0", "another kind",
                     "dropped message 1000 (999 more like it were not logged since the last "
                     "such line)"]
