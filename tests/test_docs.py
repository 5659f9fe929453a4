"""The documentation site (`mkdocs.yml`, `docs/`) builds strictly and its commands run.

- `mkdocs build --strict`: a broken link or anchor, a missing page or an API reference (`::: module.name`) that
  no longer resolves fails the build; the generated CLI and RunConfig pages (`docs/hooks.py`) hold every
  command, flag and key.
- Every `hf-fedtask ...` command in a ```bash block of any page parses with the real parser
  (`hf_fedtask.cli.build_parser`), and `run` / `flower run` commands also build their RunConfig (a strategy
  option the strategy does not have is refused there), so a renamed or removed flag fails here. Every ```python
  block compiles and its `from hf_fedtask... import name` lines resolve (a block that includes a script with
  pymdownx.snippets, `--8<-- "examples/x.py"`, is checked as that script); every ```yaml block is a valid RunConfig.
- The pages marked `docs_test: run` in their front matter (the first-run and own-dataset tutorials, the task-vector
  concepts) are executed top to bottom in a fresh folder, at a small size: each ```bash block runs in bash with
  `hf-fedtask` wrapped so that `hf-fedtask run` gets SMALL_RUN (and the page's `docs_test_small`) appended
  (argparse keeps the last value of a flag), each ```python block in a fresh interpreter. Pages marked
  `docs_test: slow` (the first LLM run: SmolLM2 on a CPU, a few minutes) run the same way under `-m slow`.

Markers, an HTML comment on the line before a block (invisible on the site):
`<!-- docs-test: skip -->` (not executed, still checked), `<!-- docs-test: exit N -->` (the block must exit N;
when the next block is ```text, its first line must appear in the output).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md"))
# appended to every `hf-fedtask run` of an executed page: one round of one local step, 16 test examples a task
SMALL_RUN = "--rounds 1 --local-steps 1 --batch-size 8 --max-test-samples 16"
MARKER = re.compile(r"<!--\s*docs-test:\s*(.*?)\s*-->")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclasses.dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str  # the docs-test marker before it, "" if none

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def front_matter(text: str) -> dict:
    if text.startswith("---\n"):
        end = text.find("\n---", 4)
        if end > 0:
            return yaml.safe_load(text[4:end]) or {}
    return {}


def expand_snippets(code: str) -> str:
    """`code` with each `--8<-- "path"` line replaced by that file, as pymdownx.snippets includes it on the site
    (paths from the repository root: `base_path` in mkdocs.yml), so an included script is checked as what it is."""
    return re.sub(r'^[ \t]*-{1,}8<-{1,}[ \t]+"([^"]+)"[ \t]*$',
                  lambda m: (ROOT / m.group(1)).read_text(encoding="utf-8").rstrip("\n"), code, flags=re.M)


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of `page` (indented ones inside lists and admonitions too), in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m.group("indent"), m.group("fence"), m.group("info").strip()
        j = i + 1
        while j < len(lines) and not (lines[j].strip() == fence and lines[j].startswith(indent)):
            j += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[i + 1:j]]
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        marker = MARKER.search(lines[k]) if k >= 0 else None
        code = expand_snippets("\n".join(body) + "\n")
        out.append(Block(page, i + 1, info.split()[0].lower() if info else "", code, marker.group(1) if marker else ""))
        i = j + 1
    return out


def all_blocks(*langs: str) -> list[Block]:
    return [b for page in PAGES for b in blocks(page) if b.lang in langs]


# --- mkdocs build --strict -----------------------------------------------------------------------------------------

def test_docs_build_strictly_with_every_command_and_key(tmp_path):
    for module in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python"):
        pytest.importorskip(module, reason="the docs need the dev extra: pip install -e '.[dev]'")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                           str(ROOT / "mkdocs.yml"), "--site-dir", str(site)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"

    from hf_fedtask.cli import build_parser
    from hf_fedtask.config import RunConfig
    from hf_fedtask.strategies.registry import strategy_configs

    sys.path.insert(0, str(DOCS))
    try:
        hooks = importlib.import_module("hooks")
    finally:
        sys.path.remove(str(DOCS))
    cli = (site / "reference" / "cli" / "index.html").read_text(encoding="utf-8")
    for words, parser in hooks.commands(build_parser()):
        assert " ".join(("hf-fedtask", *words)) in cli
        for action in parser._actions:
            for flag in action.option_strings:
                assert flag in cli, f"{flag} of hf-fedtask {' '.join(words)} is missing from the CLI reference"
    keys = (site / "reference" / "run-config" / "index.html").read_text(encoding="utf-8")
    for f in dataclasses.fields(RunConfig):
        assert f"<code>{f.name}</code>" in keys, f"RunConfig key {f.name} is missing from the reference"
    for name, config_class in strategy_configs().items():
        for f in dataclasses.fields(config_class):
            assert f"<code>{f.name}</code>" in keys, f"option {f.name} of {name} is missing from the reference"


# --- every hf-fedtask command of every page parses -----------------------------------------------------------------

SEPARATORS = {"&&", "||", ";", "|", "&", "(", ")", "((", "))", ";;"}


def commands(code: str) -> list[list[str]]:
    """The argument lists of the `hf-fedtask` commands in shell `code` (after `hf-fedtask`; also behind
    `torchrun --no-python ...` or `accelerate launch ...`)."""
    found = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
        segment: list[str] = []
        for token in [*tokens, ";"]:
            if token in SEPARATORS:
                if "hf-fedtask" in segment:
                    found.append(segment[segment.index("hf-fedtask") + 1:])
                segment = []
            else:
                segment.append(token)
    return found


def check_command(args: list[str]) -> str | None:
    """None if `hf-fedtask ARGS` parses (and, for run commands, makes a RunConfig); else what went wrong."""
    from hf_fedtask.cli import build_parser
    from hf_fedtask.config import config_from_args
    from hf_fedtask.errors import FedTaskError

    err = io.StringIO()
    parser = build_parser()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            namespace = parser.parse_args(args)
    except SystemExit as e:
        return None if e.code == 0 else err.getvalue().strip() or f"exit {e.code}"
    # argparse accepts a unique prefix of a flag: a page must spell each flag out (a renamed flag whose old name is
    # a prefix of the new one would pass otherwise)
    command = parser
    for word in args:
        sub = next((a for a in command._actions if isinstance(a, argparse._SubParsersAction)), None)
        if sub is None or word not in sub.choices:
            break
        command = sub.choices[word]
    for token in args:
        flag = token.split("=")[0]
        if flag.startswith("--") and flag not in command._option_string_actions:
            return f"{flag}: not a flag of {command.prog} (an abbreviation?)"
    if hasattr(namespace, "strategy") and not getattr(namespace, "config", None):  # run and flower run
        try:
            config_from_args(namespace)
        except FedTaskError as e:
            return str(e)
    return None


SHELL_BLOCKS = all_blocks("bash", "sh", "shell", "console")


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=str)
def test_every_hf_fedtask_command_in_the_docs_parses(block):
    expected = re.fullmatch(r"exit (\d+)", block.marker)
    for args in commands(block.code):
        problem = check_command(args)
        if expected and int(expected.group(1)) != 0:
            continue  # a command shown failing on purpose; executed pages check its exit code
        assert problem is None, f"{block}: hf-fedtask {shlex.join(args)}: {problem}"


def test_the_command_finder_sees_launchers_comments_and_continuations():
    code = ("torchrun --no-python --nproc_per_node 2 hf-fedtask run --output-dir runs/two   # a comment\n"
            "hf-fedtask flower worker --socket $FLWR_HOME/w.sock &    # background\n"
            "hf-fedtask merge --method ties A B \\\n  -o merged && ls\n"
            "for i in 0 1; do hf-fedtask inspect x-$i.safetensors; done\n")
    assert commands(code) == [["run", "--output-dir", "runs/two"],
                              ["flower", "worker", "--socket", "$FLWR_HOME/w.sock"],
                              ["merge", "--method", "ties", "A", "B", "-o", "merged"],
                              ["inspect", "x-$i.safetensors"]]
    assert check_command(["run", "--rounds", "2"]) is None
    assert "unrecognized arguments: --roundz" in check_command(["run", "--roundz", "2"])
    assert "does not support option 'kappa'" in check_command(["run", "--strategy", "fedavg", "--kappa", "2"])
    assert "not a flag of hf-fedtask run" in check_command(["run", "--output-d", "runs/x"])  # argparse's abbreviation


# --- python and yaml blocks -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", all_blocks("python", "py"), ids=str)
def test_every_python_block_compiles_and_its_hf_fedtask_imports_resolve(block):
    tree = ast.parse(block.code, filename=str(block))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "hf_fedtask":
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert alias.name == "*" or hasattr(module, alias.name) or \
                    importlib.util.find_spec(f"{node.module}.{alias.name}") is not None, \
                    f"{block}: from {node.module} import {alias.name}: no such name"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "hf_fedtask":
                    importlib.import_module(alias.name)


@pytest.mark.parametrize("block", all_blocks("yaml", "yml"), ids=str)
def test_every_yaml_block_is_a_run_config(block):
    from hf_fedtask.config import RunConfig

    if block.marker == "skip":
        pytest.skip("marked docs-test: skip")
    RunConfig.from_dict(yaml.safe_load(block.code), source=str(block))


# --- executed tutorials ---------------------------------------------------------------------------------------------

def docs_test(page: Path) -> dict:
    """The page's `docs_test` (run | slow) and `docs_test_small` (flags appended after SMALL_RUN) front matter."""
    meta = front_matter(page.read_text(encoding="utf-8"))
    return {"mode": meta.get("docs_test"), "small": meta.get("docs_test_small", "")}


EXECUTED = [pytest.param(p, marks=[pytest.mark.slow] if docs_test(p)["mode"] == "slow" else [],
                         id=str(p.relative_to(DOCS))) for p in PAGES if docs_test(p)["mode"] in ("run", "slow")]


def wrapper(small: str) -> str:
    """bash: `hf-fedtask run ...` gets the small-size flags appended; every other command runs as written."""
    return f"""hf-fedtask() {{
    if [ "${{1:-}}" = run ]; then command hf-fedtask "$@" {SMALL_RUN} {small}; else command hf-fedtask "$@"; fi
}}
"""


def test_the_tutorials_are_executed():
    executed = {p.values[0].name: docs_test(p.values[0])["mode"] for p in EXECUTED}
    assert executed.get("first-run.md") == executed.get("own-dataset.md") == "run", executed


@pytest.mark.parametrize("page", EXECUTED)
def test_tutorial_runs_at_a_small_size(page, tmp_path):
    page_blocks = blocks(page)
    bindir = str(Path(sys.executable).parent)  # this environment's hf-fedtask and python first
    env = {**os.environ, "PATH": bindir + os.pathsep + os.environ.get("PATH", ""), "NO_COLOR": "1"}
    ran = 0
    for i, block in enumerate(page_blocks):
        if block.lang not in ("bash", "sh", "python", "py") or block.marker == "skip":
            continue
        expected = re.fullmatch(r"exit (\d+)", block.marker)
        want = int(expected.group(1)) if expected else 0
        if block.lang in ("bash", "sh"):
            argv = ["bash", "-uo" if want else "-euo", "pipefail", "-c", wrapper(docs_test(page)["small"]) + block.code]
        else:
            argv = [sys.executable, "-c", block.code]
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
        output = done.stdout + done.stderr
        assert done.returncode == want, f"{block} exited {done.returncode}, not {want}:\n{block.code}\n{output[-4000:]}"
        following = page_blocks[i + 1] if i + 1 < len(page_blocks) else None
        if want and following is not None and following.lang == "text":
            first = " ".join(following.code.splitlines()[0].split())
            assert first in " ".join(output.split()), \
                f"{block}: the page shows\n{first}\nbut the command said\n{output}"
        ran += 1
    assert ran, f"{page}: no block was executed"
