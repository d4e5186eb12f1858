"""The `kvq` command group and the `kvq-build` entry point.

Thin by design: each command lives in builder/commands/<name>.py and exposes a
click object named `command`; this module discovers and registers them, and
maps kvq's typed errors to exit codes at the boundary (no traceback unless
KVQ_DEBUG=1).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import sys

import click

from runtime.errors import KvqError

from . import commands


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvq")
def cli() -> None:
    """kvq: build, check, deploy and compare LLM engines with quantized KV caches."""


def _register() -> None:
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        mod = importlib.import_module(f"{commands.__name__}.{info.name}")
        cmd = getattr(mod, "command", None)
        if isinstance(cmd, click.Command):
            cli.add_command(cmd)


_register()


def _run(entry: click.Command, args: list[str] | None = None) -> None:
    try:
        entry.main(args=args, standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except KvqError as e:
        if os.environ.get("KVQ_DEBUG") == "1":
            raise
        click.secho(f"error: {e}", fg="red", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)


def main(args: list[str] | None = None) -> None:
    _run(cli, args)


def kvq_build_main(args: list[str] | None = None) -> None:
    from .commands.build import command as build

    _run(build, args)


if __name__ == "__main__":
    main()
