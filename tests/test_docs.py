"""The docs hold mechanically: every relative link and anchor resolves, every quoted
`flexbench SUB --flag` exists, every repository path named exists, headings are unique per page.

The checks are `tests.docs_check`'s (their rules are in its docstring; its own tests are
tests/test_docs_checker.py). The CLI's parsers are built in this process: nothing is started.
"""

from __future__ import annotations

import pytest

from tests import docs_check


@pytest.mark.timeout(120)
def test_readme_docs_and_sweep_readmes_hold() -> None:
    files = docs_check.doc_files()
    assert docs_check.ROOT / "README.md" in files
    problems = docs_check.check(files)
    assert not problems, f"{len(problems)} problems in the docs:\n" + "\n".join(map(str, problems))


def test_the_license_file_is_the_license_the_package_declares() -> None:
    import tomllib

    declared = tomllib.loads((docs_check.ROOT / "pyproject.toml").read_text())["project"]
    names = {"BSD-3-Clause": "BSD 3-Clause License"}
    first = (docs_check.ROOT / "LICENSE").read_text().splitlines()[0]
    assert first == names[declared["license"]["text"]]
