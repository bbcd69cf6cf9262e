"""Hugging Face causal language models under every strategy, with no parallel code: :class:`HFCausalLM` and
:class:`HFModelMixin`.

The hooks of :class:`~lightning_parallel.module_hooks.ParallelModuleMixin` are read from the model itself, with no
code per family:

* **tensor plan** -- ``config.base_model_tp_plan`` (keys under the base model, ``model.layers.*.self_attn.q_proj``)
  plus the causal-LM class's ``_tp_plan`` (``lm_head``), mapped to the library's styles: ``colwise`` -> ``column``,
  ``rowwise`` -> ``row``, ``embedding_rowwise`` and the input embedding -> ``vocab`` (rows of the vocabulary over
  ``tp``, one all-reduce of the lookups), ``colwise_gather_output`` on the output head -> ``vocab`` (logits split by
  vocabulary, the loss under ``loss_parallel``). Attention heads and key/value heads must both divide by ``tp``
  (checked before launch). Styles the library has no equivalent for (``replicated_with_grad_allreduce``, expert
  parallel styles, ...) and families without a plan (GPT-2's ``Conv1D`` attention) are refused before launch, with
  the reason.
* **pipeline cut** -- ``config.base_model_pp_plan`` (``embed_tokens``, ``layers``, ``norm``) plus the class's
  ``_pp_plan`` (``lm_head``): the layers are the embedding, every decoder layer, the final norm and the head. A
  decoder layer needs more than the hidden states (rotary position embeddings, the causal mask): each stage computes
  them from the hidden states it receives with the family's own code (the base model's ``forward`` run up to its
  first decoder layer, with ``inputs_embeds``), once per micro-batch and shape; the pipeline carries the hidden states
  and, when the batch holds them, the ``attention_mask`` and ``position_ids`` tensors (several tensors between
  stages, :class:`~lightning_parallel.module_hooks.PipelineLayer`). Families whose decoder layers get different
  masks by layer type (``config.layer_types`` with sliding and full attention) and families whose forward changes
  the logits after the head (softcapping, a logit scale) are refused for pipelines before launch: the cut is checked
  against the model's own forward on a short input in the launching process.
* **activation checkpointing** ``full`` -- the decoder layers (``selective`` is refused: HF attention cores are
  functions, not submodules).

The loss follows Hugging Face's convention: ``labels`` default to ``input_ids``, are shifted inside (position ``t``
predicts token ``t + 1``), and ``-100`` is ignored; the loss is the mean over the counted tokens of the (micro-)batch,
and :class:`HFCausalLM`'s ``context_parallel_plan()`` names those shifted labels (:meth:`HFModelMixin.hf_labels`), so
the strategies weigh data-parallel ranks, micro-batches and accumulated batches by their counted tokens: every counted
token of an optimizer step weighs the same, as on one device taking the step's samples in one batch (a module of your
own that mixes in :class:`HFModelMixin` and trains on :meth:`HFModelMixin.hf_loss` opts in with the same plan; one
whose loss is not that token mean must not). Context parallelism is refused (the attention core is a function).
Batches are dicts with ``input_ids`` (and optionally ``labels``, ``attention_mask``, ``position_ids``), or ``(input,
target)`` pairs as :class:`~lightning_parallel.data.TextDataModule` yields them (targets already shifted).

Parameter names stay the model's own: ``model.model.layers.3.mlp.up_proj.weight`` on any stage, so checkpoints of any
layout load into the plain model. ``transformers`` is an optional dependency (``pip install lightning-parallel[hf]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_parallel.checkpoint.read import LoadsAnyFormat
from lightning_parallel.config import LayoutError, ParallelConfig
from lightning_parallel.module_hooks import ParallelModuleMixin, PipelineLayer
from lightning_parallel.parallel.pipeline import PrunedLayer

__all__ = ["HF_TP_STYLES", "HFCausalLM", "HFModelMixin", "build_hf_model", "hf_causal_loss"]

HF_TP_STYLES = {"colwise": "column", "rowwise": "row", "embedding_rowwise": "vocab",
                "colwise_gather_output": "vocab", "replicate": "replicate"}
"""Hugging Face tensor-plan styles -> the library's (:data:`~lightning_parallel.module_hooks.TP_STYLES`)."""

IGNORE_INDEX = -100


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as err:  # pragma: no cover - the hf extra is in dev
        raise ImportError("lightning_parallel.hf needs transformers: pip install 'lightning-parallel[hf]'.") from err
    return transformers


def build_hf_model(model: Any, *, pretrained: bool = True, attn_implementation: str | None = "sdpa") -> nn.Module:
    """A ``PreTrainedModel`` for causal LM from a built model (returned as is), a ``PretrainedConfig``, a dict with
    ``model_type`` (``{"model_type": "llama", "hidden_size": 64, ...}``: random init from the config) or a model id
    (``pretrained``: its weights, else random init from its config; downloads unless ``HF_HUB_OFFLINE=1`` and cached).
    """
    tf = _transformers()
    if isinstance(model, nn.Module):
        return model
    kwargs: dict[str, Any] = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    if isinstance(model, str):
        if pretrained:
            return tf.AutoModelForCausalLM.from_pretrained(model, **kwargs)  # type: ignore[no-any-return]
        model = tf.AutoConfig.from_pretrained(model)
    if isinstance(model, Mapping):
        values = dict(model)
        model_type = values.pop("model_type", None)
        if not isinstance(model_type, str):
            raise ValueError(f"HFCausalLM(model={dict(model)!r}): a config dict needs 'model_type' (e.g. 'llama', "
                             "'qwen2', 'mistral').")
        model = tf.AutoConfig.for_model(model_type, **values)
    if isinstance(model, tf.PretrainedConfig):
        return tf.AutoModelForCausalLM.from_config(model, **kwargs)  # type: ignore[no-any-return]
    raise TypeError(f"HFCausalLM(model=...) takes a model id, a config dict with 'model_type', a PretrainedConfig or a "
                    f"PreTrainedModel, got {type(model).__name__}.")


def shift_labels(labels: Tensor) -> Tensor:
    """Hugging Face's shift: position ``t`` is scored on ``labels[t + 1]``; the last position gets ``-100``."""
    return F.pad(labels[..., 1:], (0, 1), value=IGNORE_INDEX)


def hf_causal_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean cross-entropy over the positions whose (already shifted) target is not ``-100``; works on
    vocab-parallel logits under ``loss_parallel``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1),
                           ignore_index=IGNORE_INDEX)


class _StopPrelude(Exception):
    """Control flow: the base model's forward reached its decoder layers."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.args, self.kwargs = args, kwargs


class _Stop(nn.Module):
    """Stands in for the decoder layers while the base model's forward computes their inputs; stops it there."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise _StopPrelude(args, kwargs)


class HFModelMixin(ParallelModuleMixin):
    """The parallel hooks of a LightningModule holding a Hugging Face causal LM at ``self.<hf_model_attr>``.

    ``class MyModule(HFModelMixin, L.LightningModule)`` with ``self.model = AutoModelForCausalLM...`` (or set
    :attr:`hf_model_attr`) trains under every strategy: the tensor plan, the pipeline cut and the recomputed layers
    come from the model (module docstring). The module's own ``training_step`` runs under the data-parallel
    strategies and ``lp_tensor``; pipelines use :meth:`pipeline_batch` and :meth:`pipeline_loss` (HF's loss
    convention). Use :meth:`hf_loss` in ``training_step`` to get the same loss.
    """

    hf_model_attr = "model"

    # ------------------------------------------------------------------ the model and its parts
    @property
    def hf_model(self) -> Any:
        """The Hugging Face model (``PreTrainedModel``) this module holds."""
        return getattr(self, self.hf_model_attr)

    def _hf_base(self) -> Any:
        hf = self.hf_model
        return getattr(hf, hf.base_model_prefix, hf)

    def _hf_base_path(self) -> str:
        hf = self.hf_model
        prefix = getattr(hf, "base_model_prefix", "")
        return f"{self.hf_model_attr}.{prefix}" if prefix and hasattr(hf, prefix) else self.hf_model_attr

    def _hf_pp_plan(self) -> tuple[list[tuple[str, tuple[str, ...], tuple[str, ...]]], dict[str, Any]]:
        """``(base entries, top entries)``: the base model's pp plan as ``(key, inputs, outputs)`` and the causal-LM
        class's own (``lm_head``). Raises :class:`LayoutError` for a family without one, or one of another shape."""
        hf = self.hf_model
        config = hf.config
        base_plan = dict(getattr(config, "base_model_pp_plan", None) or {})
        top_plan = dict(getattr(type(hf), "_pp_plan", None) or {})
        family = f"{type(hf).__name__} ({getattr(config, 'model_type', '?')})"
        if not base_plan or not top_plan:
            raise LayoutError(
                f"{family} has no pipeline plan (config.base_model_pp_plan / {type(hf).__name__}._pp_plan), so the "
                "library cannot cut it into pipeline stages. Fix: a data-parallel or tensor-parallel strategy, or "
                "implement pipeline_layers() on your LightningModule."
            )
        entries = [(k, tuple(v[0]), tuple(v[1])) for k, v in base_plan.items()]
        lists = [k for k, _, _ in entries if isinstance(getattr(self._hf_base(), k, None), nn.ModuleList)]
        shape_ok = (len(entries) >= 2 and entries[0][1] == ("input_ids",) and len(lists) == 1
                    and all(ins[:1] == ("hidden_states",) for _, ins, _ in entries[1:])
                    and len(top_plan) == 1)
        if not shape_ok:
            raise LayoutError(
                f"{family}: its pipeline plan {base_plan} + {top_plan} is not 'embedding, decoder layers, norms, "
                "head', the shape the library cuts. Fix: a data-parallel or tensor-parallel strategy, or implement "
                "pipeline_layers()."
            )
        return entries, top_plan

    # ------------------------------------------------------------------ pipeline
    def _hf_prelude(self, *, input_ids: Tensor | None = None, inputs_embeds: Tensor | None = None,
                    attention_mask: Tensor | None = None, position_ids: Tensor | None = None
                    ) -> tuple[Tensor, dict[str, Any]]:
        """Run the base model's forward up to its first decoder layer: ``(hidden states, keyword arguments)`` that
        layer gets (position embeddings, causal mask, position ids: the family's own code computes them)."""
        base = self._hf_base()
        entries, _ = self._hf_pp_plan()
        key = next(k for k, _, _ in entries if isinstance(getattr(base, k, None), nn.ModuleList))
        layers = base._modules[key]
        base._modules[key] = nn.ModuleList([_Stop()])
        try:
            base(input_ids=input_ids, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                 position_ids=position_ids, use_cache=False)
        except _StopPrelude as stop:
            args, kwargs = stop.args, dict(stop.kwargs)
        else:
            raise RuntimeError(f"{type(base).__name__}.forward never called its decoder layers.")
        finally:
            base._modules[key] = layers
        hidden = args[0] if args else kwargs.pop("hidden_states")
        return hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"}

    def _hf_layer_kwargs(self, hidden: Tensor, attention_mask: Tensor | None,
                         position_ids: Tensor | None) -> dict[str, Any]:
        """The decoder layers' keyword arguments for hidden states of this shape (and this mask / these positions),
        computed once and reused while they stay the same objects."""
        key = (tuple(hidden.shape), hidden.dtype, hidden.device, attention_mask, position_ids)
        memo = self.__dict__.get("_lp_hf_prelude_memo")
        if memo is not None and memo[0][:3] == key[:3] and memo[0][3] is key[3] and memo[0][4] is key[4]:
            return memo[1]  # type: ignore[no-any-return]
        _, kwargs = self._hf_prelude(inputs_embeds=hidden.detach(), attention_mask=attention_mask,
                                     position_ids=position_ids)
        self.__dict__["_lp_hf_prelude_memo"] = (key, kwargs)
        return kwargs

    def _hf_embed(self, _embedding: nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                  position_ids: Tensor | None) -> Tensor:
        hidden, _ = self._hf_prelude(input_ids=input_ids, attention_mask=attention_mask,
                                     position_ids=position_ids)
        return hidden

    def _hf_layer(self, layer: nn.Module, hidden: Tensor, attention_mask: Tensor | None,
                  position_ids: Tensor | None) -> Tensor:
        out = layer(hidden, **self._hf_layer_kwargs(hidden, attention_mask, position_ids))
        return out[0] if isinstance(out, tuple) else out  # type: ignore[no-any-return]

    def pipeline_layers(self) -> list[nn.Module | PipelineLayer]:
        """The embedding, each decoder layer, the norm(s) and the head, from the model's pipeline plan; the layers
        another pipeline stage holds are left out. The embedding and each decoder layer read the batch's optional
        ``attention_mask`` and ``position_ids``."""
        entries, top = self._hf_pp_plan()
        base, hf = self._hf_base(), self.hf_model
        extra = ("attention_mask", "position_ids")
        layers: list[nn.Module | PipelineLayer] = []
        for i, (key, _ins, _outs) in enumerate(entries):
            module = getattr(base, key, None)
            if module is None:
                continue
            if i == 0:
                layers.append(PipelineLayer(module, inputs=("input_ids", *extra), outputs=("hidden_states",),
                                            call=self._hf_embed, optional=extra))
            elif isinstance(module, nn.ModuleList):
                layers.extend(PipelineLayer(layer, inputs=("hidden_states", *extra), outputs=("hidden_states",),
                                            call=self._hf_layer, optional=extra)
                              for layer in module if not isinstance(layer, PrunedLayer))
            else:
                layers.append(PipelineLayer(module, inputs=("hidden_states",), outputs=("hidden_states",)))
        for key in top:
            head = getattr(hf, key, None)
            if head is not None:
                layers.append(PipelineLayer(head, inputs=("hidden_states",), outputs=("logits",)))
        return layers

    def pipeline_batch(self, batch: Any) -> tuple[Any, Tensor | None]:
        """A dict batch -> ``({input_ids[, attention_mask, position_ids]}, shifted labels)``; an ``(input, target)``
        pair (targets already shifted, as :class:`~lightning_parallel.data.TextDataModule`'s) -> as it is."""
        if isinstance(batch, Mapping):
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "position_ids") if batch.get(k) is not None}
            labels = batch.get("labels")
            return inputs, shift_labels(batch["input_ids"] if labels is None else labels)
        return super().pipeline_batch(batch)

    def pipeline_loss(self, output: Tensor, target: Tensor) -> Tensor:
        return hf_causal_loss(output, target)

    # ------------------------------------------------------------------ the loss's tokens
    def hf_labels(self, batch: Any) -> Tensor:
        """The labels :meth:`hf_loss` counts on ``batch``: a dict batch's ``labels`` (or ``input_ids``) shifted, an
        ``(input, target)`` pair's target -- the target the mixin's :meth:`pipeline_batch` returns. A module whose loss
        is that token mean names them, so that the strategies weigh every counted token of an optimizer step once
        (:class:`HFCausalLM` does)::

            def context_parallel_plan(self):
                return {"labels": self.hf_labels}
        """
        return self._hf_split(batch)[1]

    def _hf_split(self, batch: Any) -> tuple[Any, Tensor]:
        """``(model inputs, shifted target)`` of ``batch`` as :meth:`hf_loss` and :meth:`hf_labels` read it (the
        mixin's own :meth:`pipeline_batch`, whatever a subclass does with its pipeline's batches)."""
        inputs, target = HFModelMixin.pipeline_batch(self, batch)
        if target is None:
            raise ValueError("a batch without targets (give (input, target) or a dict with input_ids).")
        return inputs, target

    # ------------------------------------------------------------------ loss of the model's own forward
    def hf_loss(self, batch: Any) -> Tensor:
        """The model's loss on ``batch`` by Hugging Face's convention (see the module docstring): the mean over the
        counted tokens of :meth:`hf_labels`."""
        inputs, target = self._hf_split(batch)
        if isinstance(inputs, Mapping):
            kwargs = {k: v for k, v in inputs.items() if k != "input_ids"}
            logits = self.hf_model(input_ids=inputs["input_ids"], use_cache=False, **kwargs).logits
        else:
            logits = self.hf_model(input_ids=inputs, use_cache=False).logits
        return hf_causal_loss(logits, target)

    # ------------------------------------------------------------------ tensor plan
    def tensor_parallel_plan(self) -> dict[str, Any]:
        """``config.base_model_tp_plan`` under the base model, the class's ``_tp_plan`` under the model, and the
        input embedding as ``vocab``; styles mapped by :data:`HF_TP_STYLES`."""
        hf = self.hf_model
        base_path = self._hf_base_path()
        base_plan = dict(getattr(hf.config, "base_model_tp_plan", None) or {})
        top_plan = dict(getattr(type(hf), "_tp_plan", None) or {})
        family = f"{type(hf).__name__} ({getattr(hf.config, 'model_type', '?')})"
        if not base_plan:
            raise LayoutError(
                f"{family} has no tensor-parallel plan (config.base_model_tp_plan is empty"
                f"{'; its attention uses Conv1D layers' if _has_conv1d(hf) else ''}), so the library cannot split "
                "it over tp. Fix: tensor_parallel_size=1 (lp_ddp, lp_sharded, lp_pipeline), or implement "
                "tensor_parallel_plan() on your LightningModule."
            )
        plan: dict[str, Any] = {}
        embed = getattr(self._hf_base(), "embed_tokens", None)
        entries = [(f"{base_path}.{k}", v) for k, v in base_plan.items()]
        entries += [(f"{self.hf_model_attr}.{k}", v) for k, v in top_plan.items()]
        if isinstance(embed, nn.Embedding) and f"{base_path}.embed_tokens" not in dict(entries):
            entries.insert(0, (f"{base_path}.embed_tokens", "embedding_rowwise"))
        for key, style in entries:
            if style not in HF_TP_STYLES:
                raise LayoutError(
                    f"{family}: its tensor plan gives {key.split('.', 1)[1]!r} the style {style!r}, which the "
                    f"library has no equivalent for (it maps {sorted(HF_TP_STYLES)}). Fix: tensor_parallel_size=1, "
                    "or override tensor_parallel_plan() on your LightningModule."
                )
            plan[key] = HF_TP_STYLES[style]
        return plan

    # ------------------------------------------------------------------ checks before launch
    def parallel_shape(self) -> dict[str, int]:
        config = self.hf_model.config
        return {"n_layer": int(config.num_hidden_layers), "n_head": int(config.num_attention_heads),
                "vocab_size": int(config.vocab_size)}

    def check_parallel_layout(self, layout: ParallelConfig) -> None:
        """Before launch: no context parallelism (the attention core is a function); tensor parallelism needs a plan
        the library maps, attention and key/value heads divisible by ``tp``, untied embeddings and no sequence
        parallelism; a pipeline needs a pipeline plan the cut reproduces (checked against the model's own
        forward)."""
        hf = self.hf_model
        config = hf.config
        family = f"{type(hf).__name__} ({getattr(config, 'model_type', '?')})"
        if layout.context_parallel_size > 1:
            raise LayoutError(
                f"parallel.context_parallel_size={layout.context_parallel_size}: context parallelism replaces "
                f"parameter-free attention-core submodules with ring attention; {family}'s attention core is a "
                "function, not a submodule (and its labels are shifted inside the loss, across the chunks a cp rank "
                "would hold). Fix: context_parallel_size=1 (long sequences: activation_checkpointing='full', or "
                "a model whose attention core is a submodule)."
            )
        tp = layout.tensor_parallel_size
        if tp > 1:
            self.tensor_parallel_plan()  # refuses a missing plan or an unknown style
            for key in ("num_attention_heads", "num_key_value_heads"):
                heads = getattr(config, key, None)
                if isinstance(heads, int) and heads % tp:
                    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
                    raise LayoutError(
                        f"parallel.tensor_parallel_size={tp} does not divide {family}'s {key}={heads}: {heads} % {tp} "
                        f"= {heads % tp} (each tp rank computes whole heads). Fix: tensor_parallel_size in "
                        f"{divisors}."
                    )
            if layout.sequence_parallel:
                raise LayoutError(
                    f"parallel.sequence_parallel=True: {family}'s tensor plan has no sequence-parallel norms (its "
                    "norms and rotary embeddings run on whole sequences). Fix: sequence_parallel=False."
                )
            if _tied(hf):
                raise LayoutError(
                    f"{family} ties its input embedding and output head (tie_word_embeddings=True); the library splits "
                    "them over tp separately, which would untie them. Fix: a config with tie_word_embeddings=False, "
                    "or tensor_parallel_size=1."
                )
        if layout.pipeline_parallel_size > 1:
            self.check_pipeline_cut()

    def check_pipeline_cut(self) -> None:
        """Refuse (:class:`LayoutError`) a family the pipeline cut does not reproduce: decoder layers of several
        attention types, or a forward that differs from the layers run in order (e.g. logit softcapping); the
        second is checked by running both on a short input when the model is on a real device."""
        hf = self.hf_model
        config = hf.config
        family = f"{type(hf).__name__} ({getattr(config, 'model_type', '?')})"
        self._hf_pp_plan()
        kinds = sorted(set(getattr(config, "layer_types", None) or []))
        if len(kinds) > 1:
            raise LayoutError(
                f"{family}'s decoder layers are of several attention types {kinds} (config.layer_types), each with its "
                "own mask; the pipeline cut passes every layer the same one. Fix: a data-parallel or tensor-parallel "
                "strategy."
            )
        params = list(hf.parameters())
        if not params or any(p.is_meta for p in params):
            return
        device = params[0].device
        ids = torch.arange(min(6, int(config.vocab_size)), device=device).unsqueeze(0) % int(config.vocab_size)
        training = hf.training
        hf.eval()
        try:
            with torch.no_grad():
                want = hf(input_ids=ids, use_cache=False).logits
                carry: dict[str, Any] = {"input_ids": ids}
                for layer in self.pipeline_layers():
                    assert isinstance(layer, PipelineLayer)
                    out = layer(*(carry.get(n) for n in layer.inputs))
                    carry[layer.outputs[0]] = out
                got = carry["logits"]
        finally:
            hf.train(training)
        if got.shape != want.shape or not torch.allclose(got.float(), want.float(), rtol=1e-4, atol=1e-4):
            diff = float((got.float() - want.float()).abs().max()) if got.shape == want.shape else float("nan")
            raise LayoutError(
                f"{family}: running its pipeline layers in order (embedding, decoder layers, norm, head) does not "
                f"give the model's own logits (max difference {diff:.3g}); its forward does more than the pipeline "
                "plan says (e.g. logit softcapping or scaling). Fix: a data-parallel or tensor-parallel strategy, or "
                "implement pipeline_layers() on your LightningModule."
            )

    # ------------------------------------------------------------------ recomputation
    def full_checkpointing_modules(self) -> list[str]:
        """Each decoder layer present (``model.model.layers.<i>``)."""
        base_path = self._hf_base_path()
        base = self._hf_base()
        out = []
        for key, module in base.named_children():
            if isinstance(module, nn.ModuleList):
                out += [f"{base_path}.{key}.{i}" for i, layer in enumerate(module)
                        if not isinstance(layer, PrunedLayer)]
        return out

    def selective_checkpointing_modules(self) -> list[str]:
        raise LayoutError(
            f"activation_checkpointing='selective' recomputes parameter-free attention-core submodules; "
            f"{type(self.hf_model).__name__}'s attention core is a function, not a submodule. Fix: "
            "activation_checkpointing='full' (recomputes each decoder layer)."
        )


def _has_conv1d(model: nn.Module) -> bool:
    return any(type(m).__name__ == "Conv1D" for m in model.modules())


def _tied(model: Any) -> bool:
    get_in, get_out = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    if not callable(get_in) or not callable(get_out):
        return False
    a, b = get_in(), get_out()
    return a is not None and b is not None and getattr(a, "weight", None) is getattr(b, "weight", None)


class HFCausalLM(HFModelMixin, LoadsAnyFormat, pl.LightningModule):
    """A Hugging Face causal LM as a LightningModule, trained with its own loss convention under any strategy.

    Args:
        model: a model id (``"Qwen/Qwen2-0.5B"``), a config dict with ``model_type`` (random init:
            ``{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, ...}``), a ``PretrainedConfig``, or
            a built ``PreTrainedModel``.
        pretrained: for a model id, load its weights (else random init from its config).
        attn_implementation: for models built here (``"sdpa"``, ``"eager"``, ...).
        lr, weight_decay, betas: AdamW (weight decay on matrices only). warmup_steps: linear warmup, then constant.

    The hyperparameters hold the model's config as a dict, so ``HFCausalLM.load_from_checkpoint`` rebuilds it.
    """

    resume_free_hparams = ("pretrained", "attn_implementation")
    """Init arguments a checkpoint may have been saved with other values of: a checkpoint's weights replace the
    downloaded ones (the hyperparameters save ``pretrained=False`` so that loading rebuilds without a download), and
    the attention kernel does not change the weights."""

    def __init__(self, model: Any = None, *, pretrained: bool = True, attn_implementation: str | None = "sdpa",
                 lr: float = 1e-3, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.95),
                 warmup_steps: int = 0) -> None:
        super().__init__()
        if model is None:
            raise ValueError("HFCausalLM(model=...) is required: a model id, a config dict with 'model_type', a "
                             "PretrainedConfig or a PreTrainedModel.")
        self.model = build_hf_model(model, pretrained=pretrained, attn_implementation=attn_implementation)
        config = self.model.config.to_dict()  # type: ignore[union-attr,operator]
        self.save_hyperparameters(ignore=["model"])
        self.hparams["model"] = {k: v for k, v in config.items() if not k.startswith("_")}
        self.hparams["pretrained"] = False

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        """The logits ``(batch, sequence, vocab)``."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                          use_cache=False).logits  # type: ignore[no-any-return]

    def context_parallel_plan(self) -> dict[str, Any]:
        """The loss is :meth:`~HFModelMixin.hf_loss`, a mean over the counted tokens (labels other than -100): the
        strategies weigh data-parallel ranks, a pipeline's micro-batches and a step's accumulated batches by their
        counted tokens (:meth:`~HFModelMixin.hf_labels`), so padding and masked prompts weigh as on one device
        taking the step's batch whole. No attention is routed: context parallelism is refused
        (:meth:`~HFModelMixin.check_parallel_layout`)."""
        return {"labels": self.hf_labels, "ignore_index": IGNORE_INDEX}

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.hf_loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.hf_loss(batch)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def test_step(self, batch: Any, batch_idx: int) -> Tensor:
        loss = self.hf_loss(batch)
        self.log("test_loss", loss, sync_dist=True)
        return loss

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Tensor:
        if isinstance(batch, Mapping):
            return self(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
        return self(batch if isinstance(batch, Tensor) else batch[0])

    def configure_optimizers(self) -> Any:
        hp: Any = self.hparams
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": hp.weight_decay},
                                       {"params": no_decay, "weight_decay": 0.0}], lr=hp.lr, betas=tuple(hp.betas))
        warmup = max(0, int(hp.warmup_steps))
        if warmup == 0:
            return optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

