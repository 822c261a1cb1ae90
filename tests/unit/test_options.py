"""One options object owns the defaults; the command line shows them without torch."""

from __future__ import annotations

import subprocess
import sys

from kvdepot.options import DEFAULTS, Options


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
