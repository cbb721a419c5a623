"""Print ``name==version`` for every ``name>=version`` pyproject.toml declares
for the named packages (default: the Hugging Face ones the lower-bound job
installs), so that `.ci/run`'s second job tests exactly the declared floor.

    python .ci/lower_bounds.py                    # transformers==5.23.0 peft==0.19.1 ...
    python .ci/lower_bounds.py torch ray          # the floors the first job runs on
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import tomllib

DEFAULT = ("transformers", "peft", "torchao")


def floors(pyproject: Path) -> dict[str, str]:
    """Every ``name>=version`` requirement of the project and its extras."""
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    found: dict[str, str] = {}
    for req in requirements:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?>=([0-9.]+)", req.replace(" ", ""))
        if match:
            name, version = match.groups()
            if found.setdefault(name, version) != version:
                raise SystemExit(
                    f"{name} has two floors in pyproject.toml: {found[name]}, {version}"
                )
    return found


def main(names: list[str]) -> None:
    found = floors(Path(__file__).resolve().parent.parent / "pyproject.toml")
    missing = [n for n in names if n not in found]
    if missing:
        raise SystemExit(f"no 'name>=version' floor in pyproject.toml for {', '.join(missing)}")
    print(" ".join(f"{name}=={found[name]}" for name in names))


if __name__ == "__main__":
    main(sys.argv[1:] or list(DEFAULT))
