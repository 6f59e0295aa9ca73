"""`celery -A workers.app flower` without Flower installed: a command that names the extra to install.

Registered as the `flower` command of Celery's `celery.commands` entry points (pyproject.toml), beside
Flower's own. With Flower installed it is Flower's command itself (the same object, whichever of the two
Celery loads last); without it, Celery would answer "No such command 'flower'" and name nothing to install.
"""

from __future__ import annotations

from typing import cast

import click

from workers.base.extras import missing_modules
from workers.errors import MissingExtra


def _flower_command() -> click.Command:
    missing = missing_modules("flower")
    if not missing:
        from flower.command import flower as command  # noqa: PLC0415  (Flower's own, when installed)

        return cast(click.Command, command)

    @click.command(
        name="flower",
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
        add_help_option=False,
        help="Flower (not installed: pip install 'forkq[flower]').",
    )
    def flower_missing() -> None:
        raise click.UsageError(str(MissingExtra("celery -A workers.app flower", "flower", missing)))

    return flower_missing


flower = _flower_command()
