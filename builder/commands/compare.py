"""`kvq compare`: engines side by side on memory, throughput and accuracy."""

from __future__ import annotations

from pathlib import Path

import click

from recipes import load_recipe
from recipes.schema import CompareSection
from runtime.errors import InputError

from ..atomic import atomic_dir
from ..compare import Workload, compare_engines, engines_from_dirs
from ..planner import parse_bytes
from ..run import build_pipeline, resolve_device


@click.command("compare")
@click.argument("engine_dirs", nargs=-1, type=click.Path(file_okay=False, path_type=Path))
@click.option("--recipe", default=None, help="Build the recipe's compare.variants and compare them.")
@click.option("--set", "overrides", multiple=True, metavar="KEY.PATH=VALUE")
@click.option("--work-dir", type=click.Path(file_okay=False, path_type=Path), default=Path("kvq-work"),
              show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Report directory (engine-directory mode; default kvq-work/compare/adhoc).")
@click.option("--device", default="auto", show_default=True)
@click.option("--memory-budget", default=None, help="KV pool budget per engine, e.g. 256MiB.")
@click.option("--concurrency", default=None, help="Concurrency levels, e.g. 1,4,16.")
@click.option("--prompt-len", type=int, default=None)
@click.option("--output-len", type=int, default=None)
@click.option("--requests", "num_requests", type=int, default=None)
@click.option("--triton", "triton_urls", multiple=True, metavar="LABEL=GRPC_URL",
              help="Also measure a deployed engine through Triton (kvq bench), e.g. fp8=127.0.0.1:8001.")
def command(engine_dirs, recipe, overrides, work_dir, out, device, memory_budget, concurrency, prompt_len,
            output_len, num_requests, triton_urls) -> None:
    """Compare ENGINE_DIRS (built engines; the first is the baseline), or a recipe's variants."""
    if recipe and engine_dirs:
        raise InputError("give either engine directories or --recipe, not both.")
    if recipe:
        r = load_recipe(recipe, overrides)
        build_pipeline(r, work_dir, until="compare", device=device, force=("compare",),
                       allow_accuracy_regression=True)
        return
    if not engine_dirs:
        raise InputError("nothing to compare: give engine directories (kvq-work/engines/NAME/engine) or --recipe.")
    for d in engine_dirs:
        if not (d / "config.json").is_file():
            raise InputError(f"{d} is not an engine directory (no config.json); build one with kvq-build.")
    c = CompareSection()
    levels = c.concurrency
    if concurrency:
        try:
            levels = sorted({int(x) for x in concurrency.split(",") if x.strip()})
        except ValueError:
            raise InputError(f"--concurrency {concurrency!r}: give integers separated by commas.") from None
    wl = Workload(prompt_len or c.prompt_len, output_len or c.output_len, levels, num_requests or c.num_requests,
                  c.seed, parse_bytes(memory_budget) if memory_budget else None)
    target = out or work_dir / "compare" / "adhoc"
    dev = resolve_device(device)
    servers = []
    for item in triton_urls:
        label, sep, url = item.partition("=")
        if not sep or not label or not url:
            raise InputError(f"--triton {item!r}: write LABEL=GRPC_URL, e.g. fp8=127.0.0.1:8001.")
        servers.append((label, url))
    with atomic_dir(target, overwrite=True) as tmp:
        res = compare_engines(engines_from_dirs(list(engine_dirs)), wl, dev, tmp, "kvq compare", triton=servers)
    click.echo(f"{res['summary']}\nreport: {target / 'report.md'}")
