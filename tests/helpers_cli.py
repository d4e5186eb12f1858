"""Running the kvq CLI in-process, as a user's shell would, for tests that check exit codes and messages."""

from __future__ import annotations

import pytest


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `kvq ARGS` run through builder.cli.main."""
    from builder.cli import main

    with pytest.raises(SystemExit) as info:
        main([*args])
        raise SystemExit(0)
    out = capsys.readouterr()
    return info.value.code or 0, out.out + out.err
