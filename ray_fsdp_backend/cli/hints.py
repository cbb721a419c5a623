"""What a config's own comments say to run first.

The examples name, in their header comments, the command that creates what
they read (``python -m ray_fsdp_backend.models.tiny_pretrained /tmp/...``).
On a fresh clone those paths do not exist yet; ``validate`` then prints
each such command whose path is missing under the config's errors, so the
error comes with its fix.
"""

from __future__ import annotations

import os
import re

_COMMAND = re.compile(r"^#\s*(python -m \S+.*)$")


def setup_commands(config_path: str) -> list[str]:
    """The ``python -m`` commands in the config's comments that name an
    absolute path that does not exist yet."""
    try:
        with open(config_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    commands = []
    for line in lines:
        match = _COMMAND.match(line.strip())
        if not match:
            continue
        paths = [word for word in match.group(1).split() if word.startswith("/")]
        if any(not os.path.exists(p) for p in paths):
            commands.append(match.group(1).strip())
    return commands
