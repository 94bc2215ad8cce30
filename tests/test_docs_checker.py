"""`tests.docs_check` on small Markdown snippets: it fails on each kind of problem, passes on
good input, and skips what its rules call placeholders and outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import docs_check

# A stand-in CLI: the checker's rules, not this repository's parsers, are under test here.
COMMANDS = {"compare": frozenset({"-h", "--help", "--inter-bw", "--inter-lat", "--same-compute",
                                  "--out"}),
            "report": frozenset({"-h", "--help", "--same-compute", "--step-noise"})}


def _flags(command: str) -> frozenset[str] | None:
    return COMMANDS.get(command)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A repository with a README, two docs pages and a few files the snippets name."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "experiments").mkdir()
    (tmp_path / "experiments" / "cli.py").write_text("")
    (tmp_path / "results" / "quick").mkdir(parents=True)
    (tmp_path / "Makefile").write_text("")
    (tmp_path / "docs" / "comparing.md").write_text(
        "# Comparing methods\n\n## Compute basis: `--same-compute`\n\n## Step noise\n")
    return tmp_path


def _check(repo: Path, text: str, name: str = "docs/page.md") -> list[docs_check.Problem]:
    page = repo / name
    page.write_text(text)
    return docs_check.check_file(page, repo, _flags)


def _kinds(problems: list[docs_check.Problem]) -> list[str]:
    return [p.kind for p in problems]


GOOD = """# A page

What it answers.

## Heading one

See [comparing](comparing.md), its [basis](comparing.md#compute-basis---same-compute),
[step noise](comparing.md#step-noise), [below](#heading-two), [the sweep](../results/quick/)
and [the code](../experiments/cli.py#L10), [a site](https://example.org/x#y).

## Heading two

Run `flexbench compare results/quick --inter-bw 1Gbit --same-compute all`, read
`experiments/cli.py:12`, `Makefile`, `results/quick/`, and write `--out runs/mine/cmp.json`.
Placeholders: `results/SWEEP/summary.md`, `results/<sweep>/README.md`, `units/M-s0`,
`experiments/configs/*.toml`, `flexbench COMMAND --help`, `docs/F.csv`.

```bash
flexbench compare results/quick --inter-bw 1Gbit \\
    --inter-lat 20ms --out results/new.json   # a comment: flexbench nothing --here
flexbench report results/quick --same-compute method | head
```

### A heading with `code`, punctuation (too) & ünïcode — and more
[self](#a-heading-with-code-punctuation-too--ünïcode--and-more)
"""


@pytest.mark.timeout(30)
def test_good_input_passes(repo: Path) -> None:
    assert _check(repo, GOOD) == []


@pytest.mark.timeout(30)
def test_a_broken_link_fails(repo: Path) -> None:
    problems = _check(repo, "# T\n\nSee [methods](methods.md) and [ok](comparing.md).\n")
    assert _kinds(problems) == ["link"] and "no docs/methods.md" in problems[0].text
    assert problems[0].line == 3 and problems[0].file == "docs/page.md"


@pytest.mark.timeout(30)
def test_a_broken_anchor_fails_on_this_page_and_another(repo: Path) -> None:
    problems = _check(repo, "# T\n\n[a](#nowhere) [b](comparing.md#compute-basis) [c](#t)\n")
    assert _kinds(problems) == ["anchor", "anchor"]
    assert "#nowhere in this page" in problems[0].text
    assert "#compute-basis in docs/comparing.md" in problems[1].text


@pytest.mark.timeout(30)
def test_a_renamed_flag_fails_in_inline_code_and_continued_code_lines(repo: Path) -> None:
    problems = _check(repo, "# T\n\nRun `flexbench compare --same-compute-basis all`.\n\n"
                            "```\nflexbench report results/quick \\\n  --step-noise \\\n"
                            "  --same-compute method --steps 3\n"
                            ".venv/bin/flexbench compare x --inter-bw 1Gbit --inter-lag 1ms\n```\n")
    assert _kinds(problems) == ["flag", "flag", "flag"]
    assert "`flexbench compare --inter-lag`" in problems[2].text and problems[2].line == 9
    assert "`flexbench compare --same-compute-basis`" in problems[0].text
    assert "`flexbench report --steps`" in problems[1].text and problems[1].line == 6


@pytest.mark.timeout(30)
def test_an_unknown_subcommand_fails(repo: Path) -> None:
    problems = _check(repo, "# T\n\n`flexbench plan --nodes 8`\n\n```\nflexbench simulate x\n```\n")
    assert _kinds(problems) == ["command", "command"]
    assert "`flexbench plan`" in problems[0].text and "`flexbench simulate`" in problems[1].text


@pytest.mark.timeout(30)
def test_a_missing_path_fails(repo: Path) -> None:
    problems = _check(repo, "# T\n\nIn `experiments/replay/cli.py`, `.ci/run` and "
                            "`pyproject.toml`; `runs/x` is the user's.\n")
    assert sorted(p.text for p in problems) == ["`.ci/run` does not exist",
                                                "`experiments/replay/cli.py` does not exist",
                                                "`pyproject.toml` does not exist"]


@pytest.mark.timeout(30)
def test_a_duplicate_heading_fails_and_its_numbered_anchor_resolves(repo: Path) -> None:
    problems = _check(repo, "# T\n\n## Usage\n\n## Usage\n\n[second](#usage-1)\n\n"
                            "```\n# Usage\n```\n")
    assert _kinds(problems) == ["heading"] and problems[0].line == 5
    assert "repeats the heading of line 3 (anchor #usage)" in problems[0].text


@pytest.mark.timeout(30)
def test_slugs_follow_githubs_rule() -> None:
    assert docs_check.slug("Sites (`--topology F.toml`)") == "sites---topology-ftoml"
    assert docs_check.slug("Time to target: 2× [1.9–2.3]") == "time-to-target-2-1923"
    assert docs_check.slug("The `run_digest` check") == "the-run_digest-check"
    assert docs_check.slug("[Linked](x.md) heading") == "linked-heading"


@pytest.mark.timeout(30)
def test_placeholders_are_told_apart_from_paths() -> None:
    for token in ("results/SWEEP", "units/M-s0", "runs/DIR", "F.csv", "results/<sweep>/x",
                  "experiments/configs/*.toml", "docs/{a,b}.md", "$HOME/x", "results/.../x"):
        assert docs_check.is_placeholder(token), token
    for token in ("results/quick/README.md", "experiments/cli.py", "Makefile",
                  "results/quick/units/hsdp-adamw-s0-1Gbit_1ms", "docs/cost-model.md"):
        assert not docs_check.is_placeholder(token), token
