"""Mechanical checks of the project's Markdown: links, anchors, commands and flags, paths, headings.

    python -m tests.docs_check    # every problem of README.md, docs/*.md, results/*/README.md

What is checked, per file (`check_file`):
- links: a relative link target (inline `[text](target)` or a reference definition
  `[label]: target`) resolves to a file or folder, relative to the file (a target starting with
  `/` from the repository root); `#anchor` (alone, or after a .md target) names a heading of that
  page by GitHub's slug rule (`slug`) or an HTML `<a name=...>`/`id=...` anchor.
- commands: `flexbench SUB` in a fenced code block or inline code (`.venv/bin/flexbench SUB`
  too) names a subcommand of
  `experiments.cli`, and every `--flag` after it (on the same command: lines ending in a
  backslash continue it; `|`, `;`, `&&`, a `#` comment and the end of the span end it) is an
  option of that subcommand's parser (`--help` always is). The parsers are built in-process
  from `experiments.cli.build_parser`; nothing is run.
- paths: a token of inline code that starts with a top-level folder (`TOP_DIRS`) followed by
  `/`, or is a top-level file (`TOP_FILES`), exists. A `:line` or `::name` suffix and trailing
  punctuation are dropped first. Skipped: placeholders (`is_placeholder`) and outputs (the
  token after `--out`, `--out-dir`, `-o` or `>`); paths under `runs/` are never checked (not a
  top-level folder: user output).
- headings: the headings of one file (ATX `#` headings outside fenced code blocks) have
  distinct slugs.

A placeholder is a token containing one of `< > * { } [ ] $ …` or `...`, or one with a part (the
text between `/ - _ . = :`) written in capitals (A-Z and digits, with at least one letter),
other than a conventional capitalised file name (`CAPS_NAMES`: README, LICENSE, ...): `METHOD`,
`units/M-s0`, `runs/DIR`, `F.csv`, `results/SWEEP/summary.md` are placeholders a user fills in.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
import unicodedata
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]

TOP_DIRS = ("flexdemo", "netsim", "experiments", "results", "docs", "benchmarks", "tests",
            "notebooks", ".ci")
TOP_FILES = ("Makefile", "pyproject.toml", "README.md", ".gitignore")
CAPS_NAMES = frozenset({"README", "LICENSE", "CHANGELOG", "CONTRIBUTING", "DESIGN", "RULES",
                        "NOTICE", "AUTHORS", "MANIFEST"})
OUTPUT_FLAGS = frozenset({"--out", "--out-dir", "-o", ">"})
PLACEHOLDER_CHARS = frozenset("<>*{}[]$…") | {"..."}

# Subcommand -> its parser's option strings; None for a name that is no subcommand.
Flags = Callable[[str], "frozenset[str] | None"]

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:name|id)\s*=\s*[\"']([^\"']+)[\"']", re.IGNORECASE)
# `flexbench` as a word (also `.venv/bin/flexbench`), its subcommand, and the rest of its command.
_COMMAND = re.compile(r"(?<![\w.-])flexbench\s+([^\s|;&#]+)((?:[^|;&#]|&(?!&))*)")
_FLAG = re.compile(r"(?<![\w-])(--[A-Za-z0-9][\w-]*)")
_CAPS_PART = re.compile(r"^[A-Z0-9]*[A-Z][A-Z0-9]*$")


@dataclass(frozen=True)
class Problem:
    """One thing in a Markdown file that does not hold: where, of which kind, and what."""

    file: str
    line: int
    kind: str
    """link, anchor, command, flag, path or heading."""
    text: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.kind}: {self.text}"


def slug(text: str) -> str:
    """GitHub's anchor of a heading's text: rendered text lowercased, every character but
    letters, digits, marks, `-`, `_` and spaces dropped, each space made a `-`."""
    text = _INLINE_CODE.sub(lambda m: m.group(2), text)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link reads as its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML renders as nothing of the heading's text
    kept = [c for c in text.strip().lower()
            if c in "-_ " or unicodedata.category(c)[0] in "LNM"]
    return "".join(kept).replace(" ", "-")


def headings(lines: list[str]) -> list[tuple[int, str, str]]:
    """(line number, heading text, unique slug) of each heading outside code blocks; a repeated
    slug gets -1, -2, ... as GitHub numbers it."""
    seen: dict[str, int] = {}
    found = []
    for number, line, in_code in _lines(lines):
        match = None if in_code else _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.append((number, match.group(2), base if count == 0 else f"{base}-{count}"))
    return found


def anchors(lines: list[str]) -> set[str]:
    """Every anchor a page offers: its headings' slugs and its HTML `name`/`id` anchors."""
    html = {m.group(1) for _, line, code in _lines(lines) if not code
            for m in _HTML_ANCHOR.finditer(line)}
    return {s for _, _, s in headings(lines)} | html


def _lines(lines: list[str]) -> Iterator[tuple[int, str, bool]]:
    """(1-based number, line, inside a fenced code block) per line; fences count as code."""
    fence: str | None = None
    for number, line in enumerate(lines, start=1):
        match = _FENCE.match(line)
        if match and (fence is None or (match.group(1)[0] == fence[0]
                                        and len(match.group(1)) >= len(fence))):
            fence = match.group(1) if fence is None else None
            yield number, line, True
            continue
        yield number, line, fence is not None


def is_placeholder(token: str) -> bool:
    """Whether a path token is a placeholder the user fills in (see the module's rule)."""
    if any(c in token for c in PLACEHOLDER_CHARS):
        return True
    parts = [p for p in re.split(r"[/\-_.=:]", token) if p]
    return any(_CAPS_PART.match(p) and p not in CAPS_NAMES for p in parts)


@functools.cache
def cli_flags(command: str) -> frozenset[str] | None:
    """The option strings of `flexbench COMMAND`'s parser (None: no such subcommand); the
    parser is `experiments.cli.build_parser`'s, built in this process."""
    from experiments import cli

    if command not in cli.COMMANDS:
        return None
    parser = cli.build_parser([command])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return frozenset(sub.choices[command]._option_string_actions)


def check_file(path: Path, root: Path = ROOT, flags: Flags = cli_flags) -> list[Problem]:
    """Every problem of one Markdown file (the module's four checks)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    name = _name(path, root)
    problems = [Problem(name, n, kind, text) for n, kind, text in _problems(path, lines, root,
                                                                           flags)]
    return sorted(problems, key=lambda p: (p.line, p.kind, p.text))


def _problems(path: Path, lines: list[str], root: Path,
              flags: Flags) -> Iterator[tuple[int, str, str]]:
    """(line, kind, text) of each problem of `lines` (the file at `path`)."""
    first: dict[str, int] = {}
    for number, text, _ in headings(lines):
        base = slug(text)
        if base in first:
            yield number, "heading", (f"{text!r} repeats the heading of line {first[base]} "
                                      f"(anchor #{base})")
        first.setdefault(base, number)
    own = anchors(lines)
    command: list[tuple[int, str]] = []  # a code block's command so far (continued lines)
    for number, line, in_code in _lines(lines):
        if in_code:
            if _FENCE.match(line):
                command = []
                continue
            command.append((number, line))
            if line.rstrip().endswith("\\"):
                continue
            start = command[0][0]
            joined = " ".join(text.rstrip().removesuffix("\\") for _, text in command)
            command = []
            yield from ((start, k, t) for k, t in _commands(_drop_comment(joined), flags))
            continue
        spans = [m.group(2) for m in _INLINE_CODE.finditer(line)]
        prose = _INLINE_CODE.sub("", line)
        for span in spans:
            yield from ((number, k, t) for k, t in _commands(span, flags))
            yield from ((number, "path", t) for t in _paths(span, root))
        targets = [m.group(1) for m in _LINK.finditer(prose)]
        reference = _REFERENCE.match(prose)
        targets += [reference.group(1)] if reference else []
        for target in targets:
            yield from ((number, k, t) for k, t in _link(path, target, own, root))


def _drop_comment(line: str) -> str:
    """A shell line without its `# comment` (a `#` at the start or after a space)."""
    return re.split(r"(?:^|\s)#", line, maxsplit=1)[0]


def _commands(text: str, flags: Flags) -> Iterator[tuple[str, str]]:
    """("command" | "flag", what) for each `flexbench SUB --flag ...` in `text` that is wrong."""
    for match in _COMMAND.finditer(text):
        sub, rest = match.group(1), match.group(2)
        if sub.startswith("-") or is_placeholder(sub) or not re.fullmatch(r"[a-z][a-z-]*", sub):
            continue  # `flexbench --help`, `flexbench COMMAND`, `flexbench <sub>`: no claim
        known = flags(sub)
        if known is None:
            yield "command", f"`flexbench {sub}`: no such subcommand"
            continue
        for flag in _FLAG.findall(rest):
            if flag not in known and flag != "--help":
                yield "flag", f"`flexbench {sub} {flag}`: no such option"


def _paths(span: str, root: Path) -> Iterator[str]:
    """Each repository path named in an inline code span that is missing."""
    tokens = re.split(r"[\s=,;()\"']+", span)
    for before, token in zip(["", *tokens], tokens, strict=False):
        if before in OUTPUT_FLAGS:
            continue
        token = re.sub(r"::?[\w.\-]*$", "", token).rstrip(".:;!?")
        if not _is_repo_path(token) or is_placeholder(token):
            continue
        if not (root / token).exists():
            yield f"`{token}` does not exist"


def _is_repo_path(token: str) -> bool:
    """Whether a token names a repository path: a top-level folder and more, or a top file."""
    return token in TOP_FILES or any(token.startswith(d + "/") for d in TOP_DIRS)


def _link(path: Path, target: str, own: set[str], root: Path) -> Iterator[tuple[str, str]]:
    """("link" | "anchor", what) when a relative link or its anchor does not resolve."""
    if not target or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):
        return  # http:, https:, mailto:: not this repository's to check
    file_part, _, anchor = target.partition("#")
    file_part = unquote(file_part)
    if file_part and is_placeholder(file_part):
        return
    if file_part:
        where = (root / file_part.lstrip("/")) if file_part.startswith("/") \
            else (path.parent / file_part)
        if not where.exists():
            yield "link", f"({target}) does not resolve: no {_name(where, root)}"
            return
        if not anchor:
            return
        if where.suffix != ".md" or where.is_dir():
            return  # an anchor into a non-Markdown file: GitHub's line anchors, not checked
        offered = _anchors_of(where.resolve())
    else:
        offered = own
    if anchor and anchor not in offered:
        page = _name(where, root) if file_part else "this page"
        yield "anchor", f"({target}): no heading #{anchor} in {page}"


@functools.cache
def _anchors_of(path: Path) -> frozenset[str]:
    """The anchors of another Markdown page (read once)."""
    return frozenset(anchors(path.read_text(encoding="utf-8").splitlines()))


def _name(path: Path, root: Path) -> str:
    """A path as the repository names it (relative to its root where it is inside)."""
    try:
        return str(path.resolve().relative_to(root.resolve()))
    except ValueError:
        return str(path)


def doc_files(root: Path = ROOT) -> list[Path]:
    """The files the docs test checks: README.md, docs/*.md and results/*/README.md."""
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")),
             *sorted((root / "results").glob("*/README.md"))]
    return [f for f in files if f.is_file()]


def check(files: Iterable[Path] | None = None, root: Path = ROOT,
          flags: Flags = cli_flags) -> list[Problem]:
    """Every problem in `files` (default: `doc_files`)."""
    return [p for f in (doc_files(root) if files is None else files)
            for p in check_file(f, root, flags)]


if __name__ == "__main__":
    found = check([Path(a) for a in sys.argv[1:]] or None)
    print("\n".join(map(str, found)) or "no problems")
    sys.exit(1 if found else 0)
