"""The transformers compatibility layer (``ray_fsdp_backend/compat/transformers.py``):
the version floor refuses an older release by name, the mask builders give
transformers' own masks on the installed release, and no other module of the
package or the tests reaches into transformers' internals."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ray_fsdp_backend.compat import transformers as compat

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("installed", ["4.57.6", "5.22.2", "5.0.0.dev0"])
def test_an_older_transformers_is_refused_naming_both_versions(installed):
    with pytest.raises(ImportError, match=rf"transformers=={installed} is older than 5\.23"):
        compat.check_transformers_version(installed)


@pytest.mark.parametrize("installed", ["5.23.0", "5.25.0", "5.30.0.dev0", "6.0"])
def test_the_floor_and_newer_pass(installed):
    compat.check_transformers_version(installed)


def test_masks_split_packed_documents_on_the_installed_release():
    tf = pytest.importorskip("transformers")
    config = tf.MistralConfig(sliding_window=3, hidden_size=8, num_attention_heads=2)
    config._attn_implementation = "sdpa"
    positions = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    embeds = torch.empty(1, 8, 8)
    full = compat.create_causal_mask(config, embeds, position_ids=positions)
    window = compat.create_sliding_window_causal_mask(config, embeds, position_ids=positions)
    q, k = torch.arange(8)[:, None], torch.arange(8)[None, :]
    same_doc = (q >= 5) == (k >= 5)
    assert torch.equal(full[0, 0], (k <= q) & same_doc)
    assert torch.equal(window[0, 0], (k <= q) & (q - k < 3) & same_doc)


COMPAT = REPO / "ray_fsdp_backend" / "compat" / "transformers.py"


def test_only_compat_imports_transformers_internals():
    internal = re.compile(r"^\s*(from|import) transformers\.(?!models\.auto\b)", re.M)
    offenders = [
        str(path.relative_to(REPO))
        for root in ("ray_fsdp_backend", "tests")
        for path in (REPO / root).rglob("*.py")
        if path != COMPAT and internal.search(path.read_text())
    ]
    assert offenders == [], (
        "import transformers internals through ray_fsdp_backend/compat/transformers.py"
    )
