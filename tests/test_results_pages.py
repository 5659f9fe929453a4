"""The results pages' writer (`hf_fedtask.workflows.recipe.write_results_page`): a recipe's table goes into a
marked section of a Markdown page, replaced on a rerun, with the command, commit, hardware and date beside it; and
the shipped pages under docs/results/ name the command that regenerates them."""

from __future__ import annotations

import re
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import pytest

from hf_fedtask.workflows.recipe import (
    publish_results,
    recipe_command,
    recipe_parser,
    source_commit,
    write_results_page,
)

ROOT = Path(__file__).resolve().parents[1]
WHEN = datetime(2025, 1, 2, 3, 4, tzinfo=timezone.utc)


def test_a_section_is_replaced_in_place_and_the_rest_of_the_page_kept(tmp_path):
    page = tmp_path / "matu.md"
    page.write_text("# MaTU\n\nIntro.\n\n<!-- results:a start -->\nold A\n<!-- results:a end -->\n\nBetween.\n")
    command = ["python", "recipes/matu_8task.py", "--seeds", "0", "--output-dir", "runs/it's"]
    write_results_page(page, "b", "| m | acc |\n|---|---|\n| matu | 1.0 |\n", command, repo=tmp_path, when=WHEN)
    write_results_page(page, "a", "| m | acc |\n|---|---|\n| fedavg | 2.0 |", command, repo=tmp_path, when=WHEN)
    text = page.read_text()
    assert text.startswith("# MaTU\n\nIntro.\n\n<!-- results:a start -->")  # A where it was, B appended
    assert text.index("| fedavg | 2.0 |") < text.index("Between.") < text.index("<!-- results:b start -->")
    assert "old A" not in text and text.count("<!-- results:a start -->") == text.count("<!-- results:a end -->") == 1
    write_results_page(page, "b", "| m | acc |\n|---|---|\n| matu | 3.0 |", command, repo=tmp_path, when=WHEN)
    text = page.read_text()
    assert "| matu | 1.0 |" not in text and "| matu | 3.0 |" in text and text.count("results:b start") == 1
    assert "Intro." in text and "Between." in text and "| fedavg | 2.0 |" in text
    b = text[text.index("<!-- results:b start -->"):text.index("<!-- results:b end -->")]
    assert "2025-01-02 03:04 UTC" in b
    assert "- commit: `unknown`" in b  # tmp_path is no git checkout
    assert re.search(r"- hardware: .+, \d+ cores available \(of \d+\), \d+ torch threads; (GPU: .+|no CUDA GPU)", b)
    assert "```bash\npython recipes/matu_8task.py --seeds 0 --output-dir 'runs/it'\"'\"'s'\n```" in b  # shell-quoted


def test_new_sections_go_before_the_pages_mark(tmp_path):
    page = tmp_path / "tct.md"
    page.write_text("# TCT\n\n## Latest runs\n\n<!-- results:new -->\n\n## Recorded by earlier runs\n\nold\n")
    for section in ("one", "two", "one"):
        write_results_page(page, section, f"table {section}", ["python", "r.py"], repo=tmp_path, when=WHEN)
    text = page.read_text()
    assert text.index("results:one start") < text.index("results:two start") < text.index("<!-- results:new -->") \
        < text.index("## Recorded by earlier runs")
    assert text.count("results:one start") == 1 and text.endswith("old\n")


def test_a_new_page_is_created_with_a_title(tmp_path):
    page = tmp_path / "results" / "dp.md"
    write_results_page(page, "dp table!", "table", ["python", "recipes/dp_table.py"], repo=tmp_path, when=WHEN)
    text = page.read_text()
    assert text.startswith("# dp\n\n<!-- results:dp-table start -->")
    assert text.endswith("<!-- results:dp-table end -->\n")


def test_the_commit_names_uncommitted_changes_but_not_the_results_pages(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.org", "-C", str(tmp_path)]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# page\n")
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert source_commit(tmp_path) == head
    write_results_page(tmp_path / "docs" / "page.md", "s", "table", ["python", "r.py"], repo=tmp_path, when=WHEN)
    assert source_commit(tmp_path, ignore=[tmp_path / "docs"]) == head  # the page being written does not count
    assert f"- commit: `{head}`" in (tmp_path / "docs" / "page.md").read_text()
    (tmp_path / "code.py").write_text("x = 2\n")
    assert source_commit(tmp_path, ignore=[tmp_path / "docs"]) == f"{head} + uncommitted changes"


def test_recipes_take_results_page_and_name_their_command(tmp_path, monkeypatch, capsys):
    args = recipe_parser("r", {}).parse_args(["--output-dir", "runs/x", "--results-page", str(tmp_path / "p.md")])
    assert args.results_section is None
    monkeypatch.chdir(ROOT)
    assert recipe_command(ROOT / "recipes" / "tct_text.py", ["--rounds", "2"]) == [
        "python", "recipes/tct_text.py", "--rounds", "2"]
    assert publish_results(args, "runs/x", "| t |", ["--rounds", "2"], ROOT / "recipes" / "tct_text.py") == \
        tmp_path / "p.md"
    assert "<!-- results:x start -->" in (tmp_path / "p.md").read_text()
    assert "results page:" in capsys.readouterr().out
    none = recipe_parser("r", {}).parse_args([])
    assert publish_results(none, "runs/x", "| t |", []) is None  # no page unless asked


def test_a_results_section_without_a_page_is_refused_before_any_run(tmp_path):
    """`--results-section` names a section of `--results-page`: alone it would be accepted and ignored."""
    import subprocess
    import sys

    from hf_fedtask.errors import ConfigError
    from hf_fedtask.workflows.recipe import recipe_config

    args = recipe_parser("r", {}).parse_args(["--output-dir", str(tmp_path / "x"), "--results-section", "s"])
    with pytest.raises(ConfigError, match=r"^--results-section s: names a section of --results-page"):
        recipe_config(args, {}, {})
    done = subprocess.run([sys.executable, str(ROOT / "recipes" / "matu_label_skew.py"), "--tabulate-only",
                           "--output-dir", str(tmp_path / "y"), "--results-section", "s"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "matu_label_skew.py: error: --results-section s: names a section of --results-page, which was not given; "
        "add --results-page docs/results/<paper>.md or leave it out"]
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


PAGES = {"matu": "matu_8task.py", "fedyolo": "fedyolo_multitask.py", "ntkfedavg": "ntkfedavg_8task.py",
         "tct": "tct_fmnist.py", "f2l2": "f2l2_backdoor.py", "dp": "dp_table.py", "llm": "llm_manytask.py"}


@pytest.mark.parametrize("name", sorted(PAGES))
def test_each_results_page_names_the_command_that_regenerates_it(name):
    text = (ROOT / "docs" / "results" / f"{name}.md").read_text()
    assert f"--results-page docs/results/{name}.md" in text and f"recipes/{PAGES[name]}" in text
