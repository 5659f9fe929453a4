"""MkDocs hooks (`hooks:` in mkdocs.yml): the reference pages generated from the code at build time, so that
they never drift from it, and the Results section listed from whatever `docs/results/` holds.

- `<!-- generated: cli -->`: `hf-fedtask <command> --help` for every command and subcommand, from the
  parser `hf_fedtask.cli.build_parser` builds (argparse's own help text, 100 columns wide).
- `<!-- generated: run-config -->`: every `RunConfig` key with its flag, type, default, allowed values and
  help, read from the dataclass fields (`hf_fedtask.core.fields.option`, `allowed_values`).
- `<!-- generated: strategy-options -->`: each strategy's options, from its config class
  (`hf_fedtask.strategies.registry.strategy_configs`, `hf_fedtask.strategies.configs`).
- `<!-- generated: builtin-tasks -->`: every builtin task of `builtin-30` / `builtin-8`, from the registry
  (`hf_fedtask.data.builtin_tasks`).

Everything imported here is light (no torch, datasets or transformers: `tests/test_cli_startup.py` holds the CLI
and RunConfig to that), so the build stays fast and offline.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from contextlib import contextmanager
from pathlib import Path

MARKER = re.compile(r"<!--\s*generated:\s*([a-z-]+)\s*-->")
HELP_COLUMNS = "100"


# --- the Results section: every page under docs/results/, index first ------------------------------------------

def on_config(config, **kwargs):
    """Fill the nav entry `Results` with the pages `docs/results/` holds at build time (index.md first, the others
    by name); drop the entry when there are none."""
    nav = config.get("nav")
    if not nav:
        return config
    folder = Path(config["docs_dir"]) / "results"
    pages = sorted(p.relative_to(config["docs_dir"]).as_posix() for p in folder.rglob("*.md")) if folder.is_dir() \
        else []
    pages.sort(key=lambda p: (p != "results/index.md", p))
    for i, item in enumerate(list(nav)):
        if isinstance(item, dict) and "Results" in item:
            if pages:
                nav[i] = {"Results": pages}
            else:
                nav.remove(item)
    return config


# --- generated reference pages ------------------------------------------------------------------------------------

def on_page_markdown(markdown, page, config, files, **kwargs):
    return MARKER.sub(lambda m: RENDERERS[m.group(1)](), markdown)


@contextmanager
def _columns(width: str):
    """argparse reads the terminal width from $COLUMNS: fix it, so the pages do not depend on who builds them."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def commands(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    """(words, parser) for `parser` and every (sub)command under it, in the order they were added."""
    yield words, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from commands(sub, (*words, name))


def render_cli() -> str:
    from hf_fedtask.cli import build_parser

    out = []
    with _columns(HELP_COLUMNS):
        for words, parser in commands(build_parser()):
            title = " ".join(("hf-fedtask", *words))
            out.append(f"## `{title}`\n\n```text\n{parser.format_help().rstrip()}\n```\n")
    return "\n".join(out)


def _cell(text) -> str:
    """`text` safe inside a Markdown table cell."""
    text = " ".join(str(text).split())
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|") \
        .replace("*", "\\*")


def _type_words(cls, f: dataclasses.Field) -> str:
    from hf_fedtask.core.fields import field_type

    kind, is_list, optional = field_type(cls, f.name)
    words = f"list of {kind.__name__}" if is_list else kind.__name__
    return words + (" or null" if optional else "")


def _default_words(f: dataclasses.Field) -> str:
    value = f.default_factory() if f.default is dataclasses.MISSING else f.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple, dict)) and not value:
        return "[]" if not isinstance(value, dict) else "{}"
    return str(value)


def _field_rows(cls, flags: bool = True) -> list[str]:
    from hf_fedtask.core.fields import allowed_values

    rows = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        meta = f.metadata or {}
        flag = "`--" + f.name.replace("_", "-") + "`" if flags and f.name != "strategy_options" else "(YAML / Python)"
        rows.append(f"| `{f.name}` | {flag} | {_cell(_type_words(cls, f))} | `{_cell(_default_words(f))}` | "
                    f"{_cell(allowed_values(f) or '')} | {_cell(meta.get('help', ''))} |")
    return rows


TABLE_HEAD = "| key | flag | type | default | allowed | what it sets |\n|---|---|---|---|---|---|"


def render_run_config() -> str:
    from hf_fedtask.config import RunConfig

    return "\n".join([TABLE_HEAD, *_field_rows(RunConfig)]) + "\n"


def render_strategy_options() -> str:
    from hf_fedtask.strategies.registry import strategy_configs

    out = []
    for name, cls in strategy_configs().items():
        doc = " ".join((cls.__doc__ or "").split())
        out.append(f"### `{name}`\n\n`{cls.__module__}.{cls.__name__}`: {doc}\n")
        rows = _field_rows(cls)
        out.append("\n".join([TABLE_HEAD, *rows]) + "\n" if rows else "It has no options.\n")
    return "\n".join(out)


def render_builtin_tasks() -> str:
    """Every builtin task with its group, labels, question, license and suites, from the registry
    (`hf_fedtask.data.builtin_tasks`: declarations only, no datasets imported)."""
    from hf_fedtask.data.builtin_tasks import BUILTIN_TASKS, SUITES

    rows = ["| task | group | labels | question | license | conflict group | builtin-8 |",
            "|---|---|---|---|---|---|---|"]
    for name, spec in BUILTIN_TASKS.items():
        rows.append(f"| `{name}` | {_cell(spec.group)} | {_cell(', '.join(spec.labels))} | "
                    f"{_cell(spec.description)} | {_cell(spec.license)} | {_cell(spec.conflict_group or '')} | "
                    f"{'yes' if name in SUITES['builtin-8'] else ''} |")
    return "\n".join(rows) + "\n"


RENDERERS = {"cli": render_cli, "run-config": render_run_config, "strategy-options": render_strategy_options,
             "builtin-tasks": render_builtin_tasks}
