"""One options object owns the defaults; the command line shows them without torch."""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from dataclasses import fields

from kvdepot.cli import _add_serve, serve_options
from kvdepot.options import (
    DEFAULTS,
    Options,
    default_l1_bytes,
    default_registered_bytes,
    default_transfer_threads,
)


def test_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom kvdepot.cli import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, file=sys.stderr)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stderr.strip() == "False"
    assert "serve" in out.stdout


def test_serve_command_line_defaults_are_the_options_defaults() -> None:
    out = subprocess.run([sys.executable, "-m", "kvdepot.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    text = " ".join(out.split())
    assert f"TCP port (default {DEFAULTS.port})" in text
    assert f"divide it (default {DEFAULTS.chunk_size})" in text
    assert f"expires (default {DEFAULTS.lock_ttl})" in text
    assert Options(port=6000).url == f"tcp://{DEFAULTS.host}:6000"


def _serve_args(words: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _add_serve(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *words])


def test_every_serve_argument_sets_the_option_of_its_name() -> None:
    args = _serve_args([])
    not_options = set(vars(args)) - {f.name for f in fields(Options)}
    assert not_options == {"command", "log_level"}
    # Without arguments, the options are the defaults, computed ones still unresolved.
    assert serve_options(args) == DEFAULTS


def test_serve_arguments_reach_their_options() -> None:
    options = serve_options(_serve_args([
        "--l1-size", "3GiB", "--disk-path", "/tmp/x", "--disk-size", "1GiB",
        "--tenant-quota", "a=1MiB", "--tenant-quota", "*=2MiB", "--remote", "redis://h:1",
        "--remote-piece-size", "1MiB", "--max-registered-memory", "5GiB",
        "--tenant-max-registered-memory", "2GiB", "--transfer-threads", "3"]))
    assert options.l1_bytes == 3 << 30 and options.disk_bytes == 1 << 30
    assert options.tenant_quotas == (("a", 1 << 20), ("*", 2 << 20))
    assert options.shared_tier_url == "redis://h:1" and options.shared_tier_piece_bytes == 1 << 20
    assert options.max_registered_bytes == 5 << 30
    assert options.tenant_max_registered_bytes == 2 << 30
    assert options.resolved(copy_processes=False) == options  # nothing left to compute


def test_computed_defaults_are_resolved_once_into_the_options(tmp_path) -> None:
    resolved = Options(disk_path=str(tmp_path / "not-yet" / "disk")).resolved(
        copy_processes=True)
    # Both read the memory available now, which moves a little between the two reads.
    assert resolved.l1_bytes is not None
    assert abs(resolved.l1_bytes - default_l1_bytes()) < 256 << 20
    assert resolved.transfer_threads == default_transfer_threads(True)
    assert resolved.disk_bytes is not None  # half the free space of tmp_path's file system
    assert abs(resolved.disk_bytes - shutil.disk_usage(tmp_path).free // 2) < 256 << 20
    assert not (tmp_path / "not-yet").exists()  # the disk tier creates it, privately
    total, per_tenant = default_registered_bytes()
    assert (resolved.max_registered_bytes, resolved.tenant_max_registered_bytes) == \
        (total, per_tenant)
    assert Options().resolved(copy_processes=False).disk_bytes == 0  # no disk tier
    assert resolved.resolved(copy_processes=False) == resolved


def test_the_connector_writes_no_default_of_its_own() -> None:
    from kvdepot.integrations.vllm.connector import ConnectorConfig

    defaults = {f.name: getattr(DEFAULTS, f.name) for f in fields(Options)}
    for field in fields(ConnectorConfig):
        if field.name in defaults:
            assert field.default == defaults[field.name], field.name
    assert ConnectorConfig.from_extra_config({}).preemption_wait_s == DEFAULTS.preemption_wait_s


def test_a_negative_staging_area_is_refused_by_name() -> None:
    import pytest

    from kvdepot.integrations.vllm.connector import ConnectorConfig

    assert ConnectorConfig.from_extra_config({"kvdepot.staging_mib": "0"}).staging_mib == 0
    with pytest.raises(ValueError, match=r"kvdepot\.staging_mib must be 0"):
        ConnectorConfig.from_extra_config({"kvdepot.staging_mib": -1})


def test_the_shared_tiers_old_flags_still_set_its_options() -> None:
    new = serve_options(_serve_args([
        "--shared-tier", "redis://h:1", "--shared-tier-ttl", "60", "--shared-tier-user", "u",
        "--shared-tier-password-file", "/p", "--shared-tier-ca-file", "/ca",
        "--shared-tier-timeout", "2", "--shared-tier-piece-size", "1MiB"]))
    old = serve_options(_serve_args([
        "--remote", "redis://h:1", "--remote-ttl", "60", "--remote-user", "u",
        "--remote-password-file", "/p", "--remote-ca-file", "/ca", "--remote-timeout", "2",
        "--remote-piece-size", "1MiB"]))
    assert new == old
    assert (new.shared_tier_url, new.shared_tier_ttl, new.shared_tier_user) == (
        "redis://h:1", 60, "u")
    assert (new.shared_tier_password_file, new.shared_tier_ca_file) == ("/p", "/ca")
    assert (new.shared_tier_timeout, new.shared_tier_piece_bytes) == (2, 1 << 20)
