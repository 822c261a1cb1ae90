"""The `kvdepot serve` process a `kvdepot bench transfer` run measures, with one engine
(`transfer`) or several (`transfer_engines`)."""

from __future__ import annotations

import argparse

from kvdepot.bench.transfer.load import CHUNK
from kvdepot.testbed.server_process import ServerProcess
from kvdepot.transfer.cuda_copier import MODE_VARIABLE


def default_l1_bytes(args: argparse.Namespace) -> int:
    return args.l1_size or ((8 << 30) if args.device == "cuda" else (4 << 30))


def start_server(args: argparse.Namespace, l1_bytes: int) -> ServerProcess:
    insecure = ("--insecure",) if args.insecure else ()
    threads = (("--transfer-threads", str(args.transfer_threads))
               if args.transfer_threads else ())
    server = ServerProcess(l1_size=l1_bytes, env={MODE_VARIABLE: args.copy_mode},
                           extra=(*threads, "--log-level", "WARNING", *insecure),
                           output="inherit").start()
    print(f"server: transfer threads {args.transfer_threads or 'its default'}, copy mode "
          f"{args.copy_mode}; "
          f"{args.chunks_per_op} chunks of {CHUNK} tokens per operation, {args.inflight} "
          f"in flight per direction, {args.seconds:.1f} s per phase")
    return server
