"""benchmarks/results/kernel_variants.jsonl: the side-by-side rows behind each plan rule, its Markdown table and
docs/kernels.md agree."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("variants_table", ROOT / "benchmarks" / "variants_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(table):
    return table.load(RESULTS / "kernel_variants.jsonl")


def test_markdown_is_rendered_from_the_jsonl(table, rows):
    env, data = rows
    assert (RESULTS / "kernel_variants.md").read_text() == table.render(env, data), (
        "kernel_variants.md is stale: run python -m benchmarks.variants_table")


def test_every_comparison_names_the_alternative_its_rule_picks(rows):
    _, data = rows
    groups: dict[tuple, list[dict]] = {}
    for r in data:
        assert r["rule"] and isinstance(r["chosen"], bool), r
        assert r["ms"] > 0, r
        groups.setdefault((r["rule"], r["group"], r["model"], r["batch"], r["ctx"], r["format"]), []).append(r)
    for key, members in groups.items():
        assert any(r["chosen"] for r in members), f"no chosen alternative in {key}"


def test_every_rule_has_its_reason_in_docs(rows):
    _, data = rows
    docs = (ROOT / "docs" / "kernels.md").read_text()
    plan_rules = docs.split("## Plan rules", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^- \*\*([A-Za-z_0-9]+)\*\*", plan_rules, flags=re.M))
    missing = {r["rule"] for r in data} - documented
    assert not missing, f"rules with rows in kernel_variants.jsonl but no bullet in docs/kernels.md: {sorted(missing)}"
