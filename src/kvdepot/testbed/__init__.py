"""What the benchmarks and the tests both run on: a `kvdepot serve` process and Redis
servers, vLLM engines and vLLM's OpenAI server, the seeded random checkpoint they load,
the verified workload, KV geometries, the correctness check, the example KV-aware router
and a throttled link. It reaches the server only as a process, through the clients and
the admin API (the KV geometries read `transfer.layout`: docs/design.md)."""
