"""The docs' sample output, from a real run: ``python -m benchmarks.samples``.

Runs the README's quick start (``ray-fsdp train examples/cpu_tiny.yaml``,
a local Ray cluster, about a minute on 2 cores) and writes its progress and
summary lines into every block marked ``<!-- sample: NAME -->`` (README.md's
quick start, docs/monitoring.md's progress line), so the numbers shown are
the numbers a run prints. ``tests/e2e/test_quickstart.py`` compares the
loss at steps 1 and 10 with the README's; when the trainer changes them,
run this command and commit the docs.

    python -m benchmarks.samples            # run and rewrite the samples
    python -m benchmarks.samples --check    # run and exit 1 if a sample differs
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", REPO / "docs" / "monitoring.md"]
SHOWN_ROOT = "/home/me/ray_results"
"""Where the sample says the run went (the real run uses a temporary directory)."""
_BLOCK = re.compile(r"(<!-- sample: (\w+) .*?-->\n```\n)(.*?)(```)", re.S)
_RAY_PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\(\w+ pid=\d+\)(?:\x1b\[0m)? ")


def run_quickstart() -> str:
    """The console of the quick start command, with Ray's worker prefixes removed."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    with tempfile.TemporaryDirectory() as storage:
        out = subprocess.run(
            [sys.executable, "-m", "ray_fsdp_backend.cli", "train", "examples/cpu_tiny.yaml",
             "--set", f"run.storage_path={storage}", "--set", "run.name=cpu_tiny-20261205-120000"],
            cwd=REPO, env=env, capture_output=True, text=True,
        )  # fmt: skip
        text = out.stdout + out.stderr
        if out.returncode:
            raise SystemExit(f"the quick start failed:\n{text[-4000:]}")
        return "\n".join(_RAY_PREFIX.sub("", line) for line in text.splitlines()).replace(
            storage, SHOWN_ROOT
        )


def samples(console: str) -> dict[str, str]:
    """Each sample block's text, from the quick start's console."""
    lines = console.splitlines()
    progress = [line for line in lines if re.match(r"step +\d+/\d+ \|", line)]
    step10 = next(line for line in progress if re.match(r"step +10/", line))
    summary_start = next(i for i, line in enumerate(lines) if re.match(r"loss \S+ \(step", line))
    summary = [line for line in lines[summary_start:] if re.match(r"[a-z ]+: +\S", line)]
    return {
        "quickstart": "\n".join([step10, "...", progress[-1], lines[summary_start], *summary]),
        "progress": step10,
    }


def rewrite(text: str, blocks: dict[str, str]) -> str:
    """``text`` with every marked block's body replaced."""
    return _BLOCK.sub(lambda m: m.group(1) + blocks[m.group(2)] + "\n" + m.group(4), text)


def sample_losses(text: str) -> tuple[str, str]:
    """The quick start sample's loss at step 1 and step 10, as printed."""
    body = next(m.group(3) for m in _BLOCK.finditer(text) if m.group(2) == "quickstart")
    step1 = re.search(r"^loss (\S+) \(step 1\)", body, re.M).group(1)
    step10 = re.search(r"^step +10/\d+ \| loss (\S+)", body, re.M).group(1)
    return step1, step10


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a sample differs")
    args = parser.parse_args(argv)
    blocks = samples(run_quickstart())
    stale = []
    for path in DOCS:
        old = path.read_text()
        new = rewrite(old, blocks)
        if new != old:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    verb = "differ" if args.check else "rewritten"
    print(f"{verb}: {', '.join(map(str, stale)) or 'none'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
