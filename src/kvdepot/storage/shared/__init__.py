"""The shared tier (`--shared-tier`): chunks in a Redis or Valkey cluster, so a prefix one
node computed is a hit on every node (docs/shared-tier.md). `tier.py` is the tier; the
value format, the cluster's address and secrets, the readers and writers of every shard's
connection, and the circuit breaker are the other modules."""
