"""The repository's own documentation and package metadata stand alone: no link to a file it lacks."""

from __future__ import annotations

import ast
import io
import re
import tokenize
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REPO_PATH = re.compile(r"\b(?:docs|workers|bench|deploy|tests|broker_config)/[A-Za-z0-9_./*-]*[A-Za-z0-9_*]")
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CREATED_BY_THE_READER = {"deploy/.env", "deploy/forkq.env"}  # the operator copies them from the examples
FOREIGN = re.compile(
    r"DESIGN\.md|\bshared/|\bspec/|\.\./(?!\{evil\})|\bspec §"
)  # a shared spec, design notes, a parent dir
CODE = sorted(
    path
    for folder in ("workers", "broker_config", "bench", "deploy", "tests")
    for path in (REPO / folder).rglob("*")
    # JSON: data (a vendored schema, the example parent); it holds no prose of ours
    if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".json", ".pyc")
)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_a_document_names_or_links_is_in_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")
    links = [link for link in MARKDOWN_LINK.findall(text) if "://" not in link and not link.startswith("mailto:")]
    named = [p for p in REPO_PATH.findall(text) if p not in CREATED_BY_THE_READER]

    missing = [link for link in links if not (doc.parent / link).exists()]
    missing += [path for path in named if not any(REPO.glob(path))]

    assert missing == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_no_document_points_at_a_shared_spec_or_design_file_outside_the_repository(doc: Path) -> None:
    text = doc.read_text(encoding="utf-8")

    # the one parent-directory path the docs may quote is the hostile fork id of the field report
    assert FOREIGN.findall(text) == []


def test_the_license_is_an_spdx_expression_and_the_license_file_ships() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    license_text = (REPO / "LICENSE").read_text(encoding="utf-8")

    assert project["project"]["license"] == "Apache-2.0"  # a table is deprecated (setuptools warns at every build)
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first to read SPDX strings
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text


def prose(path: Path) -> list[tuple[int, str]]:
    """(line, text) of what a file says to its reader: comments and docstrings of Python, every line of the
    rest (shell, YAML, Dockerfiles, Redis and lint configuration, Markdown)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return list(enumerate(text.splitlines(), 1))
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    found = [(token.start[0], token.string) for token in tokens if token.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            docstring = ast.get_docstring(node, clean=False)
            if docstring:
                found.append((node.body[0].lineno, docstring))
    return found


@pytest.mark.parametrize("path", CODE, ids=lambda p: str(p.relative_to(REPO)))
def test_no_comment_or_docstring_points_at_a_file_outside_the_repository_or_one_it_lacks(path: Path) -> None:
    lines = prose(path)

    foreign = [(line, hit) for line, text in lines for hit in FOREIGN.findall(text)]
    named = [(line, p) for line, text in lines for p in REPO_PATH.findall(text) if p not in CREATED_BY_THE_READER]
    missing = [(line, p) for line, p in named if not any(REPO.glob(p))]

    assert (foreign, missing) == ([], [])
