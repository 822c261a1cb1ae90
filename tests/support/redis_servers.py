"""Real Redis servers for the tests (shared with `kvdepot bench remote`)."""

from kvdepot.testbed.redis_processes import (
    RedisClusterProcesses,
    RedisProcess,
    make_test_ca,
    redis_server_binary,
)

__all__ = ["RedisClusterProcesses", "RedisProcess", "make_test_ca", "redis_server_binary"]
