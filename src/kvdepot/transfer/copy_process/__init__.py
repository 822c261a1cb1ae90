"""One process per GPU that queues and waits for every CUDA copy the server makes there.

The server's transfer threads validate an operation, pick its chunks and hold its
fence; the copies themselves are sent here (`client`), to a process of its own per GPU
(`main`), whose single queueing thread never competes for an interpreter lock with
the server's other threads (docs/benchmarks.md has the figures behind this).
"""
