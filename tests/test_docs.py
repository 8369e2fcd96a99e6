"""The README documents every setting of the service and every command of the CLI."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from kerneleval_server.config import Config

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_every_setting_is_in_the_readme_configuration_table() -> None:
    table = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    missing = [
        f.name
        for f in fields(Config)
        if f"`--{f.name.replace('_', '-')}`" not in table
        or f"`KERNELEVAL_{f.name.upper()}`" not in table
    ]
    assert missing == []


def test_readme_quick_start_is_make_serve_and_make_test() -> None:
    quick = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"^make \w+", quick, flags=re.M)
    assert commands == ["make serve", "make test"]
