"""``--ckpt_path`` against the configured model: which saved hyperparameters count as different (pure logic)."""

from __future__ import annotations

from types import SimpleNamespace

from lightning_parallel.checkpoint.summary import hparam_differences, shown
from lightning_parallel.cli import _model_class


def _d(key: str, configured: object, saved: object) -> list[tuple[str, object, object]]:
    return hparam_differences({key: saved}, {key: configured})


def test_a_configured_mapping_matches_the_whole_saved_config_it_is_part_of() -> None:
    """A Hugging Face model saves its whole config (every default filled in); a recipe sets a few keys. Before,
    the literal comparison refused every resume of such a run, on its own layout and config."""
    saved = {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "rope_theta": 10000.0, "architectures": None,
             "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert _d("model", {"model_type": "llama", "vocab_size": 128}, saved) == []
    assert _d("model", {"rope_scaling": {"factor": 2.0}}, saved) == []
    assert _d("model", {"vocab_size": 256, "hidden_size": 32}, saved) == [
        ("model.vocab_size", 256, 128)]
    assert _d("model", {"rope_scaling": {"factor": 4.0}}, saved) == [
        ("model.rope_scaling.factor", 4.0, 2.0)]
    assert _d("model", {"n_kv": 2}, saved) == [("model.n_kv", 2, None)]
    assert _d("model", "meta-llama/Llama-3.2-1B", saved) == []  # an id against its config
    assert _d("betas", [0.9, 0.95], (0.9, 0.95)) == []
    assert _d("n_embd", 64, 128) == [("n_embd", 64, 128)]


def test_the_fix_shows_values_as_a_recipe_writes_them() -> None:
    assert shown(None) == "null" and shown(False) == "false" and shown({"a": [1, 2]}) == '{"a": [1, 2]}'


def test_hugging_face_models_may_resume_with_another_pretrained_flag() -> None:
    """HFCausalLM saves ``pretrained=False`` (loading rebuilds without a download); a recipe that starts from the
    downloaded weights resumes its own checkpoint."""
    cls = _model_class(SimpleNamespace(class_path="lightning_parallel.hf.HFCausalLM"))
    assert cls is not None and "pretrained" in cls.resume_free_hparams
    assert _model_class(SimpleNamespace(class_path="no.such.Module")) is None
    assert hparam_differences({"pretrained": False, "lr": 1e-3}, {"pretrained": True, "lr": 1e-3},
                              free=cls.resume_free_hparams) == []
