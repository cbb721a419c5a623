"""The docs' sample output, from a real run: ``python -m benchmarks.samples``.

Runs the README's quick start (``ray-fsdp train examples/cpu_tiny.yaml``,
a local Ray cluster, about a minute on 2 cores) and writes its progress and
summary lines into every block marked ``<!-- sample: NAME -->`` (README.md's
quick start, docs/monitoring.md's progress line), so the numbers shown are
the numbers a run prints; then docs/finetuning.md's fine-tuning example
(``ray-fsdp train examples/finetune_hf.yaml`` on the tiny Llama it makes
first, as the page says) and docs/sft.md's (``examples/sft_chat.yaml`` on
the tiny chat Llama and its records). ``tests/e2e/test_quickstart.py``
compares the loss at steps 1 and 10 with the README's, and it,
``tests/e2e/test_finetune_hf.py`` and ``tests/e2e/test_sft.py`` the whole
console with the samples' lines; when the trainer changes them, run this
command and commit the docs.

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
DOCS = [
    REPO / "README.md",
    REPO / "docs" / "monitoring.md",
    REPO / "docs" / "finetuning.md",
    REPO / "docs" / "sft.md",
]
SHOWN_ROOT = "/home/me/ray_results"
"""Where the sample says the run went (the real run uses a temporary directory)."""
_BLOCK = re.compile(r"(<!-- sample: (\w+) .*?-->\n```\n)(.*?)(```)", re.S)
_RAY_PREFIX = re.compile(r"^(?:\x1b\[\d+m)?\(\w+ pid=\d+\)(?:\x1b\[0m)? ")


def run_quickstart() -> str:
    """The console of the quick start command, with Ray's worker prefixes removed."""
    return run_train("examples/cpu_tiny.yaml", "cpu_tiny-20261205-120000")


def run_finetune_hf() -> str:
    """The console of docs/finetuning.md's example: the tiny Llama made as
    the page says, then ``ray-fsdp train examples/finetune_hf.yaml``."""
    with tempfile.TemporaryDirectory() as tmp:
        pretrained, export = f"{tmp}/rfb-tiny-llama", f"{tmp}/rfb-tiny-llama-finetuned"
        subprocess.run(
            [sys.executable, "-m", "ray_fsdp_backend.models.tiny_pretrained", pretrained],
            cwd=REPO, env=_env(), check=True, capture_output=True,
        )  # fmt: skip
        sets = [f"model.pretrained={pretrained}", f"model.export={export}"]
        console = run_train("examples/finetune_hf.yaml", "finetune_hf-20261205-120000", sets)
        return console.replace(tmp, "/tmp")


def run_sft_chat() -> str:
    """The console of docs/sft.md's example: the tiny chat Llama and its
    records made as the page says, then ``ray-fsdp train examples/sft_chat.yaml``."""
    with tempfile.TemporaryDirectory() as tmp:
        pretrained = f"{tmp}/rfb-tiny-chat"
        subprocess.run(
            [sys.executable, "-m", "ray_fsdp_backend.models.tiny_pretrained", pretrained, "--chat"],
            cwd=REPO, env=_env(), check=True, capture_output=True,
        )  # fmt: skip
        data = f"{pretrained}/chat"
        sets = [
            f"model.pretrained={pretrained}", f"model.export={tmp}/rfb-tiny-chat-sft",
            f"data.path={data}/train.jsonl", f"data.eval_path={data}/eval.jsonl",
        ]  # fmt: skip
        console = run_train("examples/sft_chat.yaml", "sft_chat-20261205-120000", sets)
        return console.replace(tmp, "/tmp")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def run_train(example: str, name: str, sets: list[str] = ()) -> str:
    """The console of ``ray-fsdp train EXAMPLE`` on a local cluster it starts,
    as a user runs it, with Ray's worker prefixes removed."""
    with tempfile.TemporaryDirectory() as storage:
        sets = [*sets, f"run.storage_path={storage}", f"run.name={name}"]
        out = subprocess.run(
            [sys.executable, "-m", "ray_fsdp_backend.cli", "train", example,
             *[arg for item in sets for arg in ("--set", item)]],
            cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        text = out.stdout  # interleaved as a terminal shows them
        if out.returncode:
            raise SystemExit(f"{example} failed:\n{text[-4000:]}")
        return "\n".join(_RAY_PREFIX.sub("", line) for line in text.splitlines()).replace(
            storage, SHOWN_ROOT
        )


_PROGRESS = re.compile(r"step +\d+/\d+ \|")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def samples(
    console: str, finetune_console: str | None = None, sft_console: str | None = None
) -> dict[str, str]:
    """Each sample block's text, from the quick start's console: the whole
    console, its progress lines between step 10 and the last as ``...``;
    and the fine-tuning example's and the SFT example's whole consoles
    (``finetune_hf``, ``sft_chat``)."""
    lines = _lines(console)
    progress = [line for line in lines if _PROGRESS.match(line)]
    step10 = next(line for line in progress if re.match(r"step +10/", line))
    blocks = {"quickstart": "\n".join(collapse_progress(lines)), "progress": step10}
    if finetune_console is not None:
        blocks["finetune_hf"] = "\n".join(collapse_progress(_lines(finetune_console)))
    if sft_console is not None:
        blocks["sft_chat"] = "\n".join(collapse_progress(_lines(sft_console)))
    return blocks


def _lines(console: str) -> list[str]:
    return [_ANSI.sub("", line) for line in console.splitlines() if line.strip()]


def collapse_progress(lines: list[str]) -> list[str]:
    """``lines`` with the progress lines after step 10 but the last one
    replaced by one ``...`` line."""
    progress = [i for i, line in enumerate(lines) if _PROGRESS.match(line)]
    if len(progress) < 3:
        return lines
    first = next((i for i in progress if re.match(r"step +10/", lines[i])), progress[0])
    hidden = [i for i in progress if first < i < progress[-1]]
    if not hidden:
        return lines
    keep = [line for i, line in enumerate(lines) if i not in hidden or i == hidden[0]]
    keep[keep.index(lines[hidden[0]])] = "..."
    return keep


def console_shape(lines: list[str]) -> list[str]:
    """Each line with what changes from run to run made a placeholder:
    numbers (losses, rates, times, pids, ports), hex ids and the run's paths."""
    shape = []
    for line in lines:
        line = re.sub(r"(/[\w.-]+)+", "PATH", _ANSI.sub("", line))
        line = re.sub(r"\b[0-9a-f]{8,}\b", "ID", line)
        shape.append(" ".join(re.sub(r"\d[\d,.:e+-]*", "N", line).split()))
    return shape


def quickstart_sample(text: str) -> list[str]:
    """The README's quick start console, line by line."""
    return sample_lines(text, "quickstart")


def sample_lines(text: str, name: str) -> list[str]:
    """The lines of ``text``'s block marked ``<!-- sample: NAME -->``."""
    body = next(m.group(3) for m in _BLOCK.finditer(text) if m.group(2) == name)
    return body.splitlines()


def rewrite(text: str, blocks: dict[str, str]) -> str:
    """``text`` with every marked block's body replaced."""

    def block(m: re.Match) -> str:
        return m.group(1) + blocks.get(m.group(2), m.group(3).rstrip("\n")) + "\n" + m.group(4)

    return _BLOCK.sub(block, text)


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
    blocks = samples(run_quickstart(), run_finetune_hf(), run_sft_chat())
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
