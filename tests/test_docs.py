"""The repository's own documentation and package metadata stand alone: no link to a file it lacks."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
REPO_PATH = re.compile(r"\b(?:docs|workers|bench|deploy|tests|broker_config)/[A-Za-z0-9_./*-]*[A-Za-z0-9_*]")
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
CREATED_BY_THE_READER = {"deploy/.env", "deploy/forkq.env"}  # the operator copies them from the examples


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

    # a link that climbs out of the repository (`](../…)`); a hostile fork id quoted as `../{evil}` is not one
    assert re.findall(r"DESIGN\.md|shared/|spec/|\]\(\.\./", text) == []


def test_the_license_is_an_spdx_expression_and_the_license_file_ships() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    license_text = (REPO / "LICENSE").read_text(encoding="utf-8")

    assert project["project"]["license"] == "Apache-2.0"  # a table is deprecated (setuptools warns at every build)
    assert project["project"]["license-files"] == ["LICENSE"]
    assert "setuptools>=77" in project["build-system"]["requires"]  # the first to read SPDX strings
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text
