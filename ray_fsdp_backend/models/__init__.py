"""The example Llama-style decoder (:mod:`.decoder`), its shapes and presets
apart from the ``nn.Module`` (:mod:`.config`, torch-free for ``plan``), and the
tiny Hugging Face checkpoint maker the examples and tests start from
(:mod:`.tiny_pretrained`, trained on ``tiny_corpus.txt``)."""
