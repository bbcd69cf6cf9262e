"""Which FSDP2 groups ZeRO-3 makes of a module and which unit it keeps gathered into the backward (no process group:
meta-device modules)."""

from __future__ import annotations

import pytest
import torch

from lightning_parallel.models import GPT
from lightning_parallel.parallel.zero.stage3 import _groups, _units, last_in_forward


def _names(model: torch.nn.Module) -> list[list[str]]:
    return [[type(m).__name__ for m in group] for group in _groups(_units(model))]


def test_groups_and_the_kept_unit_of_the_library_gpt() -> None:
    with torch.device("meta"):
        untied, tied = GPT(n_layer=3, n_head=2, n_embd=32), GPT(n_layer=3, n_head=2, n_embd=32, tie_embeddings=True)
    assert _names(untied) == [["Block"], ["Block"], ["Block"], ["Embedding"], ["Head"]]
    assert last_in_forward(untied) is untied.head
    # the tied vocabulary matrix: the embedding and the head are one group, and nothing is kept gathered
    assert _names(tied) == [["Block"], ["Block"], ["Block"], ["Embedding", "Head"]]
    assert last_in_forward(tied) is None


def test_a_hugging_face_body_does_not_swallow_its_layers() -> None:
    """The body (``model``: embeddings, layers, final norm) holds the layers, which are units of their own: it manages
    only its own parameters, so each layer stays a group (before, every layer was merged with the body into one
    group, gathered whole); a tied head joins the body's group."""
    transformers = pytest.importorskip("transformers")
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, vocab_size=100)
    with torch.device("meta"):
        untied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
        tied = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, tie_word_embeddings=True))
    assert _names(untied) == [["LlamaDecoderLayer"]] * 3 + [["LlamaModel"], ["Linear"]]
    assert last_in_forward(untied) is untied.lm_head
    assert _names(tied) == [["LlamaDecoderLayer"]] * 3 + [["LlamaModel", "Linear"]]
    assert last_in_forward(tied) is None
