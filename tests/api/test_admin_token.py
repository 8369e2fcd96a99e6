"""The admin token the service makes when none is configured."""

from __future__ import annotations

from pathlib import Path

from kerneleval_server import config as config_mod


def test_a_generated_admin_token_never_reads_as_an_option(tmp_path: Path) -> None:
    # A bare token_urlsafe starts with "-" one time in 64: `--admin-token "$(cat ...)"` broke.
    from kerneleval_server.main import admin_token

    cfg = config_mod.Config()
    tokens = {admin_token(cfg, d) for d in (tmp_path / str(i) for i in range(8)) if not d.mkdir()}
    assert len(tokens) == 8 and all(t.startswith("ket_") and len(t) > 40 for t in tokens)
    assert admin_token(cfg, tmp_path / "0") in tokens  # read back, not made again
