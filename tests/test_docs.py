"""The README and docs/ stay true: every command line in their `bash` blocks parses with the real
command line it names (harbor-hpc's, or Harbor's own `harbor`), every Python block compiles,
every relative link leads to a file. The flows themselves run in tests/e2e (the quick start,
terminus-2, the example trainers)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)
LINK = re.compile(r"\]\(([^)#]+)(?:#[^)]*)?\)")
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def blocks(page: Path, language: str) -> list[str]:
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


def command_lines(block: str) -> list[list[str]]:
    """Each shell command of a block as words: continuations joined, comments and leading
    variable assignments dropped."""
    commands = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        while words and ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words:
            commands.append(words)
    return commands


def clis() -> dict[str, typer.Typer]:
    from harbor.cli.main import app as harbor_app

    from harbor_hpc.cli.app import app

    return {"harbor-hpc": app, "harbor": harbor_app}


def parse_error(app: typer.Typer, words: list[str]) -> str | None:
    """What the CLI says when it parses `words` (down to the subcommand they name, every
    option checked) and finds a word it does not take; None when all parse. `--help` ends the
    run once parsing is done, before anything runs."""
    result = CliRunner().invoke(app, [*words[1:], "--help"])
    if result.exit_code == 0:
        return None
    return result.output.strip() or repr(result.exception)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_line_of_a_bash_block_parses(page: Path) -> None:
    programs = clis()
    for block in blocks(page, "bash"):
        for words in command_lines(block):
            if words[0] in programs:
                error = parse_error(programs[words[0]], words)
                assert error is None, f"{page.name}: {shlex.join(words)}: {error}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_python_block_compiles_and_every_link_leads_somewhere(page: Path) -> None:
    for block in blocks(page, "python"):
        compile(block, str(page), "exec")
    text = page.read_text()
    for target in LINK.findall(text):
        if "://" not in target and not target.startswith("<"):
            assert (page.parent / target).exists(), f"{page.name}: {target} does not exist"


def test_the_readme_links_every_docs_page() -> None:
    readme = (REPO / "README.md").read_text()
    pages = {p.name for p in (REPO / "docs").glob("*.md")}
    assert pages == {Path(t).name for t in LINK.findall(readme) if t.startswith("docs/")}
