"""The `mmenc` command line: embed, config validation, help."""

from __future__ import annotations

import subprocess
import sys

from tests.server_process import REPO
from tests.test_server_e2e import jpeg


def _mmenc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "encoder_server.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_embed_prints_shape_and_norm_and_reports_bad_files(tmp_path) -> None:
    good, bad = tmp_path / "a.jpg", tmp_path / "notes.jpg"
    good.write_bytes(jpeg(320, 240))
    bad.write_bytes(b"plain text")
    result = _mmenc("embed", str(good), str(bad), str(tmp_path / "missing.jpg"))
    assert result.returncode == 1
    assert f"{good}: grid_thw=(1, 18, 22) shape=(99, 128) norm=" in result.stdout
    assert f"{bad}: error:" in result.stderr and "missing.jpg: error:" in result.stderr


def test_invalid_configuration_is_one_clear_line() -> None:
    result = _mmenc("serve", "--min-pixels", "0")
    assert result.returncode == 2
    assert result.stderr.strip() == "mmenc: error: need 0 < min_pixels <= max_pixels"
    result = _mmenc("serve", "--vision-model", "/nonexistent/model")
    assert result.returncode == 2 and "neither a preset" in result.stderr and "Traceback" not in result.stderr


def test_serve_help_lists_flags_with_defaults() -> None:
    result = _mmenc("serve", "--help")
    assert result.returncode == 0
    for flag in ("--port", "--vision-model", "--allow-private-urls", "--allowed-local-media-dir", "--max-pixels",
                 "--decode-backend", "--max-batch-tokens"):
        assert flag in result.stdout
    assert "(default: 8000)" in result.stdout
