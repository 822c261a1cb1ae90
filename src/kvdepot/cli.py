"""The `kvdepot` command: serve, inspect, benchmark, demo."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import fields

from kvdepot.options import DEFAULTS, Options, default_l1_bytes
from kvdepot.sizes import format_size, parse_size


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tenant_size(text: str) -> tuple[str, int]:
    """TENANT=SIZE, TENANT a tenant name or `*` (every named tenant without its own)."""
    from kvdepot.rpc.credentials import check_name

    tenant, sep, size = text.partition("=")
    try:
        if not sep or not tenant:
            raise ValueError("expected TENANT=SIZE, e.g. team-a=8GiB or *=1GiB")
        if tenant != "*":
            check_name("tenant", tenant)
        return tenant, parse_size(size)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None


def serve_options(args: argparse.Namespace) -> Options:
    """`kvdepot serve`'s arguments as `Options`: each argument's destination is the name
    of the field it sets (lists become tuples: options are frozen)."""
    values = {}
    for field in fields(Options):
        if hasattr(args, field.name):
            value = getattr(args, field.name)
            values[field.name] = tuple(value) if isinstance(value, list) else value
    return Options(**values)


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the KV cache server")
    p.add_argument("--host", default=DEFAULTS.host,
                   help="interface to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=DEFAULTS.port, help="TCP port (default %(default)s)")
    p.add_argument("--chunk-size", type=int, default=DEFAULTS.chunk_size,
                   help="tokens per cached chunk; engines' block sizes must divide it "
                        "(default %(default)s)")
    p.add_argument("--l1-size", dest="l1_bytes", type=_size, default=None,
                   help="CPU memory for the cache, e.g. 8GiB (default: a quarter of the "
                        f"memory available now, {format_size(default_l1_bytes())})")
    p.add_argument("--lock-ttl", type=float, default=DEFAULTS.lock_ttl,
                   help="seconds after which an unused lookup lock expires (default %(default)s)")
    p.add_argument("--transfer-threads", type=int, default=None,
                   help="threads running stores and retrieves (default: 8 when GPUs' copy "
                        "processes run the CUDA copies, else 4; the CPUs this process may "
                        "use if fewer)")
    p.add_argument("--max-locked-share", type=float, default=DEFAULTS.max_locked_share,
                   help="the share of CPU memory one tenant's lookups may hold locked; "
                        "past it a lookup locks a shorter prefix (default %(default)s)")
    p.add_argument("--disk-path", default=None,
                   help="directory for the local-disk tier (default: no disk tier); chunks "
                        "there survive a restart")
    p.add_argument("--disk-size", dest="disk_bytes", type=_size, default=None,
                   help="capacity of the disk tier (default: half the free space there)")
    p.add_argument("--max-registered-memory", dest="max_registered_bytes", type=_size,
                   default=None, metavar="SIZE",
                   help="CPU KV memory all engines may register together; past it a "
                        "registration is refused (default: the host's memory; CUDA memory "
                        "does not count)")
    p.add_argument("--tenant-max-registered-memory", dest="tenant_max_registered_bytes",
                   type=_size, default=None, metavar="SIZE",
                   help="CPU KV memory the engines of one tenant may register together "
                        "(default: half the host's memory; credentials without a tenant "
                        "have only --max-registered-memory)")
    p.add_argument("--tenant-quota", dest="tenant_quotas",
                   type=_tenant_size, action="append", default=[],
                   metavar="TENANT=SIZE",
                   help="CPU memory a tenant may hold; past it its own least recently used "
                        "chunks make room (repeatable; TENANT * applies to every tenant "
                        "without its own; default: none)")
    p.add_argument("--tenant-reserve", dest="tenant_reserves",
                   type=_tenant_size, action="append", default=[],
                   metavar="TENANT=SIZE",
                   help="CPU memory of a tenant that other tenants' stores never evict "
                        "(its guaranteed share; repeatable, * as above; default: none)")
    p.add_argument("--tenant-disk-quota", dest="tenant_disk_quotas",
                   type=_tenant_size, action="append", default=[],
                   metavar="TENANT=SIZE",
                   help="disk tier a tenant may hold (repeatable, * as above; default: none)")
    p.add_argument("--kv-events", default=None, metavar="tcp://HOST:PORT",
                   help="publish KV events (chunks stored and removed, per tier) on this "
                        "ZeroMQ PUB address (default: off; docs/kv-events.md)")
    p.add_argument("--kv-events-replay", default=None, metavar="tcp://HOST:PORT",
                   help="the KV events' replay socket (default: the events' port plus one)")
    p.add_argument("--drain-timeout", type=float, default=DEFAULTS.drain_timeout,
                   help="seconds SIGTERM waits for stores and retrieves in flight before "
                        "exiting (default %(default)s)")
    # The shared tier's flags were --remote* until it took one name (2026-12-06); the old
    # spellings still work for one release (docs/server.md).
    p.add_argument("--shared-tier", "--remote", dest="shared_tier_url", default=None,
                   metavar="URL",
                   help="the shared tier on Redis or Valkey: redis://HOST:PORT, "
                        "redis+cluster://HOST:PORT[,HOST:PORT...], rediss:// for TLS "
                        "(default: none); chunks are written behind to it and read up from it "
                        "by lookups on every node")
    p.add_argument("--shared-tier-ttl", "--remote-ttl", dest="shared_tier_ttl", type=float,
                   default=DEFAULTS.shared_tier_ttl,
                   help="seconds a chunk stays in the shared tier after its last write or read "
                        "(default %(default)s)")
    p.add_argument("--shared-tier-user", "--remote-user", dest="shared_tier_user", default=None,
                   help="ACL user for the shared tier (default: the URL's, else none)")
    p.add_argument("--shared-tier-password-file", "--remote-password-file",
                   dest="shared_tier_password_file", default=None,
                   help="file whose first line is the shared tier's password (default: "
                        "$KVDEPOT_SHARED_TIER_PASSWORD, else none); never on the command line")
    p.add_argument("--shared-tier-ca-file", "--remote-ca-file", dest="shared_tier_ca_file",
                   default=None, help="CA bundle for rediss:// (default: the system's)")
    p.add_argument("--shared-tier-timeout", "--remote-timeout", dest="shared_tier_timeout",
                   type=float, default=DEFAULTS.shared_tier_timeout,
                   help="seconds a round trip to the shared tier may take before it counts as "
                        "unreachable (default %(default)s)")
    p.add_argument("--shared-tier-piece-size", "--remote-piece-size",
                   dest="shared_tier_piece_bytes", type=_size,
                   default=DEFAULTS.shared_tier_piece_bytes,
                   help="bytes per piece of a chunk in the shared tier (default "
                        f"{format_size(DEFAULTS.shared_tier_piece_bytes)})")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics on this port (default: off)")
    p.add_argument("--metrics-host", default=DEFAULTS.metrics_host,
                   help="interface for the metrics port (default %(default)s)")
    p.add_argument("--admin-port", type=int, default=None,
                   help="serve the HTTP admin API, /metrics and the dashboard on this port "
                        "(default: off; docs/admin.md)")
    p.add_argument("--admin-host", default=DEFAULTS.admin_host,
                   help="interface for the admin port (default %(default)s); beyond loopback it "
                        "needs --admin-tls-cert/--admin-tls-key and a bearer for every endpoint")
    p.add_argument("--admin-tls-cert", default=None,
                   help="PEM certificate (chain) to serve the admin API over HTTPS")
    p.add_argument("--admin-tls-key", default=None, help="PEM private key of --admin-tls-cert")
    p.add_argument("--state-dir", default=None,
                   help="directory (0700) for the owner credential, the CURVE keypair and added "
                        "credentials (default: $KVDEPOT_STATE_DIR, else ~/.kvdepot)")
    p.add_argument("--insecure", action="store_true",
                   help="no authentication: anyone who reaches the port may read, write and "
                        "clear the cache (needed only where libzmq lacks CURVE)")
    p.add_argument("--socket-dir", default=None,
                   help="also listen in this directory (the server's uid's, writable by no "
                        "one else), for engines in other namespaces that mount it: requests "
                        "on ipc://DIR/kvdepot.sock, memory handover on DIR/handover.sock "
                        "(docs/deploy.md)")
    p.add_argument("--log-level", default="INFO")


def _admin_api_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--admin-url", default=None,
                   help="the server's admin API, http(s)://HOST:PORT of its --admin-port "
                        "(default: $KVDEPOT_ADMIN_URL)")
    p.add_argument("--url", default=DEFAULTS.url,
                   help="the server's ZeroMQ URL, to find its owner credential "
                        "(default %(default)s)")
    p.add_argument("--credentials", default=None,
                   help="credential file (default: $KVDEPOT_CREDENTIALS, else the owner "
                        "credential the server wrote for --url)")
    p.add_argument("--ca", default=None,
                   help="CA file of an HTTPS admin API (default: $KVDEPOT_ADMIN_CA, else the "
                        "system's)")


def _add_admin(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("stats", help="print the server's counters as JSON")
    p.add_argument("--url", default=DEFAULTS.url)
    p.add_argument("--credentials", default=None,
                   help="credential file (default: $KVDEPOT_CREDENTIALS, else the owner "
                        "credential the server wrote for --url)")
    p = sub.add_parser("clear", help="drop the chunks not locked or in use (all, or of a "
                                     "model, tenant or salt through the admin API)")
    _admin_api_arguments(p)
    p.add_argument("--model", default=None, help="only this model's chunks")
    p.add_argument("--tenant", default=None,
                   help="only this tenant's chunks ('-': those without a tenant)")
    p.add_argument("--salt", default=None, help="only chunks stored with this cache_salt")
    p = sub.add_parser("status", help="the server's tiers, tenants and engines as tables "
                                      "(admin API)")
    _admin_api_arguments(p)
    p.add_argument("--json", action="store_true", help="print GET /v1/status as JSON")
    p = sub.add_parser("top", help="kvdepot status, redrawn with rates (admin API)")
    _admin_api_arguments(p)
    p.add_argument("--interval", type=float, default=2.0, help="seconds between redraws")
    p.add_argument("--iterations", type=int, default=0,
                   help="stop after this many redraws (default: until Ctrl-C)")
    p = sub.add_parser("quota", help="show or set tenants' CPU memory quotas (admin API)")
    _admin_api_arguments(p)
    p.add_argument("tenant", nargs="?", default=None,
                   help="the tenant ('-': no tenant); without it, every quota")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--set", type=_size, default=None, metavar="SIZE",
                      help="cap the tenant's CPU memory, e.g. 4GiB")
    what.add_argument("--remove", action="store_true", help="remove the tenant's quota")


def _run_admin_api(args: argparse.Namespace) -> int:
    import time

    from kvdepot.client.admin_api import AdminAPI
    from kvdepot.client.status_tables import render

    api = AdminAPI(args.admin_url, url=args.url, credentials=args.credentials, ca_file=args.ca)
    if args.command == "status":
        status = api.status()
        print(json.dumps(status, indent=2) if args.json else render(status))
    elif args.command == "top":
        previous, then, done = None, 0.0, 0
        while True:
            status, now = api.status(), time.monotonic()
            screen = render(status, previous, now - then)
            print(("\x1b[H\x1b[2J" if sys.stdout.isatty() else "") + screen, flush=True)
            previous, then, done = status, now, done + 1
            if args.iterations and done >= args.iterations:
                return 0
            time.sleep(args.interval)
    elif args.command == "clear":
        tenant = "" if args.tenant == "-" else args.tenant
        print(f"dropped {api.clear(args.model, tenant, args.salt)} chunks")
    elif args.tenant is None:
        for tenant, quota in sorted(api.quotas().items()):
            print(f"{tenant or '-'}\t{format_size(quota)}")
    else:
        tenant = "" if args.tenant == "-" else args.tenant
        if args.set is not None or args.remove:
            api.set_quota(tenant, None if args.remove else args.set)
        quota = api.quota(tenant)
        print(f"{args.tenant}\t{'no quota' if quota is None else format_size(quota)}")
    return 0


def _add_credentials(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("credentials", help="add, list or remove the credentials servers accept")
    p.add_argument("--state-dir", default=None,
                   help="the servers' state directory (default: $KVDEPOT_STATE_DIR, else "
                        "~/.kvdepot)")
    actions = p.add_subparsers(dest="action", required=True)
    add = actions.add_parser("add", help="create a credential and write it to --out (0600)")
    add.add_argument("name")
    add.add_argument("--tenant", default="",
                     help="the tenant its chunks belong to (default: none, shared with the "
                          "owner's engines)")
    add.add_argument("--role", choices=("engine", "admin"), default="engine")
    add.add_argument("--out", required=True, help="file to write the credential to")
    actions.add_parser("list", help="the added credentials (no secrets)")
    bearer = actions.add_parser("bearer", help="print a credential's admin API bearer token")
    bearer.add_argument("--file", default=None,
                        help="the credential file (default: $KVDEPOT_CREDENTIALS, else the "
                             "owner credential of --url)")
    bearer.add_argument("--url", default=DEFAULTS.url)
    remove = actions.add_parser("remove", help="revoke a credential, on open connections too")
    remove.add_argument("name")


def _run_credentials(args: argparse.Namespace) -> int:
    import os
    from pathlib import Path

    from kvdepot.rpc.auth import add_credential, read_added_credentials, remove_credential
    from kvdepot.rpc.credentials import default_state_dir, ensure_private_dir

    if args.action == "bearer":
        return _print_bearer(args)
    state_dir = ensure_private_dir(Path(args.state_dir) if args.state_dir
                                   else default_state_dir())
    if args.action == "add":
        # The file first: a credential recorded but never written would be accepted by
        # every server and held by nobody.
        fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            try:
                credential = add_credential(state_dir, args.name, args.role, args.tenant)
                try:
                    f.write(credential.to_json())
                    f.flush()
                except BaseException:
                    remove_credential(state_dir, args.name)
                    raise
            except BaseException:
                os.unlink(args.out)
                raise
        print(f"wrote credential {args.name!r} (role {args.role}"
              f"{', tenant ' + args.tenant if args.tenant else ''}) to {args.out}; hand it to "
              "its user (e.g. chown it), and point KVDEPOT_CREDENTIALS at it")
    elif args.action == "list":
        for entry in read_added_credentials(state_dir):
            print(f"{entry['name']}\trole {entry['role']}\ttenant {entry['tenant'] or '-'}")
    elif not remove_credential(state_dir, args.name):
        print(f"no credential named {args.name!r} in {state_dir}", file=sys.stderr)
        return 1
    return 0


def _print_bearer(args: argparse.Namespace) -> int:
    from kvdepot.rpc.credentials import find_credential

    credential = find_credential(args.url, args.file)
    if credential is None:
        print(f"kvdepot credentials: no credential for {args.url} readable here",
              file=sys.stderr)
        return 1
    print(credential.admin_bearer())
    return 0


def _add_bench(sub: argparse._SubParsersAction, argv: list[str]) -> None:
    p = sub.add_parser("bench", help="benchmarks that print figures beside their physical limits")
    # The benchmarks import torch: declare them only for a bench command line, so that
    # `kvdepot --help` and `kvdepot serve` start without it.
    if "bench" in argv:
        from kvdepot.bench import register_commands

        register_commands(p.add_subparsers(dest="bench", required=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvdepot", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve(sub)
    _add_admin(sub)
    _add_credentials(sub)
    words = sys.argv[1:] if argv is None else argv
    _add_bench(sub, words)
    demo = sub.add_parser("demo", help="a real vLLM engine (CPU) using kvdepot")
    if "demo" in words:  # like the benchmarks: its imports only for its own command line
        from kvdepot.bench.demo import add_arguments as add_demo_arguments

        add_demo_arguments(demo)
    args = parser.parse_args(argv)

    if args.command == "serve":
        if argv is None:  # a real command line, which the re-executed server can repeat
            from kvdepot.server.streaming_stores import reexec_with_streaming_stores

            reexec_with_streaming_stores(sys.argv[1:])
        from kvdepot.errors import AddressInUse
        from kvdepot.server.serve import serve

        logging.basicConfig(level=args.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        options = serve_options(args)
        try:
            serve(options)
        except (AddressInUse, ValueError) as exc:
            print(f"kvdepot serve: {exc}", file=sys.stderr)
            return 2
        return 0
    if args.command in ("stats", "clear", "status", "top", "quota"):
        import os

        from kvdepot.client.admin import AdminClient
        from kvdepot.client.admin_api import ADMIN_URL_ENV
        from kvdepot.errors import KVDepotError

        # Without an admin API address, `clear` (of everything) still works over ZeroMQ.
        over_zmq = args.command == "stats" or (
            args.command == "clear" and not (args.admin_url or os.environ.get(ADMIN_URL_ENV))
            and args.model is None and args.tenant is None and args.salt is None)
        try:
            if not over_zmq:
                return _run_admin_api(args)
            with AdminClient(args.url, credentials=args.credentials) as admin:
                if args.command == "stats":
                    print(json.dumps(admin.stats(), indent=2, sort_keys=True))
                else:
                    print(f"dropped {admin.clear()} chunks")
        except KVDepotError as exc:  # no server, no credential, not an admin one
            print(f"kvdepot {args.command}: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            return 0
        return 0
    if args.command == "credentials":
        try:
            return _run_credentials(args)
        except (ValueError, OSError) as exc:
            print(f"kvdepot credentials: {exc}", file=sys.stderr)
            return 2
    if args.command == "bench":
        return args.run(args)
    if args.command == "demo":
        from kvdepot.bench.demo import run as run_demo

        return run_demo(args)
    return 1


if __name__ == "__main__":
    sys.exit(main())
