"""What the planner knows about a model: its parameter count, its largest layer, and (optionally) a GPT shape.

Parameter counts of a GPT-2-style decoder (pre-LN, learned positions, 4h MLP), ``L`` layers, hidden ``h``,
vocabulary ``V``, context ``s``:

* one block: ``12 h^2 + 13 h`` with biases (q, k, v, out ``4 h^2 + 4 h``; MLP ``8 h^2 + 5 h``; two LayerNorms
  ``4 h``), ``12 h^2 + 12 h`` in this library's GPT (no key bias), ``12 h^2 + 2 h`` without biases;
* embeddings ``V h + s h``; final LayerNorm ``2 h`` (``h`` without bias); head ``V h`` unless tied.

GPT-2 small (L=12, h=768, V=50257, s=1024, tied) gives 124,439,808, the count of the released model.
The largest single layer is the module with the most parameters of its own (DeepSpeed's ``model_to_params``
counts it the same way): ``max(V h, 4 h^2 + 4 h)`` -- the token embedding, or the MLP's first linear.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["MODEL_PRESETS", "ModelShape", "ModelSpec", "load_recipe"]


@dataclass(frozen=True)
class ModelShape:
    """A GPT-style decoder, in the init arguments of :class:`lightning_parallel.models.GPT`."""

    n_layer: int
    """Transformer blocks (L)."""
    n_embd: int
    """Hidden size (h)."""
    n_head: int
    """Attention heads (a); divides h."""
    vocab_size: int = 50304
    """Vocabulary (V); 50304 is GPT-2's 50257 padded to a multiple of 128 so that it splits over tp."""
    block_size: int = 2048
    """Context length the position embedding covers (s of the positional table)."""
    tie_embeddings: bool = False
    """Head shares the token embedding (counted once; a copy per pipeline stage that holds it)."""
    bias: bool = True
    """Biases in linears and LayerNorms."""
    dropout: float = 0.0
    """Dropout probability; > 0 adds Korthikanti's 1-byte dropout masks to the activations."""
    key_bias: bool = False
    """A bias on the key projection (GPT-2 has one; :class:`lightning_parallel.models.GPT` does not)."""
    n_kv_head: int | None = None
    """Key/value heads (grouped-query attention, Llama 3); None: ``n_head``."""
    ffn_hidden: int | None = None
    """The MLP's inner width; None: ``4 h``."""
    gated_mlp: bool = False
    """A SwiGLU MLP (gate, up and down projections: three matrices) instead of GPT-2's two."""
    learned_positions: bool = True
    """A learned position table (GPT-2); False for rotary positions (Llama), which have no parameters."""

    @property
    def kv_dim(self) -> int:
        """Width of the key (and of the value) projection: ``h`` without grouped-query attention."""
        return self.n_embd if self.n_kv_head is None else self.n_embd // self.n_head * self.n_kv_head

    @property
    def ffn_dim(self) -> int:
        """The MLP's inner width (``4 h`` unless given)."""
        return 4 * self.n_embd if self.ffn_hidden is None else self.ffn_hidden

    def __post_init__(self) -> None:
        for key in ("n_layer", "n_embd", "n_head", "vocab_size", "block_size"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {key}={value!r} must be a positive integer.")
        for key in ("n_kv_head", "ffn_hidden"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"model {key}={value!r} must be a positive integer (or None).")
        if self.n_kv_head is not None and self.n_head % self.n_kv_head:
            raise ValueError(f"model n_head={self.n_head} is not a multiple of n_kv_head={self.n_kv_head}. Fix: a "
                             "divisor of n_head.")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model n_embd={self.n_embd} is not divisible by n_head={self.n_head} "
                f"({self.n_embd} % {self.n_head} = {self.n_embd % self.n_head}). Fix: change one of them."
            )

    def block_matrix_params(self, tp: int = 1) -> int:
        """Parameters of one block's weight matrices (q, k, v, out, the MLP's) on one tp rank."""
        h, kv, f = self.n_embd, self.kv_dim, self.ffn_dim
        mlp_in = 2 * f if self.gated_mlp else f
        return (2 * h * h + 2 * h * kv + (mlp_in + f) * h) // tp  # 12 h^2 for GPT-2's shape

    def block_params(self, tp: int = 1) -> int:
        """Parameters of one block on one tp rank: matrices and column-parallel biases / tp, the rest replicated."""
        h, kv, f = self.n_embd, self.kv_dim, self.ffn_dim
        mlp_in = 2 * f if self.gated_mlp else f
        matrices = self.block_matrix_params(tp)
        if not self.bias:
            return matrices + 2 * h
        split_biases = h + (kv if self.key_bias else 0) + kv + mlp_in  # q, (k,) v and fc_in: column-parallel
        return matrices + split_biases // tp + 6 * h  # out_proj, fc_out biases and the LayerNorms stay whole

    @property
    def block_linears(self) -> int:
        """Linear layers of one block: q, k, v, out and the MLP's two (three gated); each is a DTensor module under
        tensor parallelism."""
        return 4 + (3 if self.gated_mlp else 2)

    @property
    def block_tensors(self) -> int:
        """Parameter tensors of one block (what a per-tensor optimizer steps one by one): q, k, v, out and the MLP's
        two (three gated) matrices, their biases (k's only with ``key_bias``), two norms' weights (and biases): 15
        for :class:`lightning_parallel.models.GPT`, 9 for Llama."""
        matrices = self.block_linears
        if not self.bias:
            return matrices + 2
        return 2 * matrices - (0 if self.key_bias else 1) + 4

    def edge_tensors(self, *, first: bool = True, last: bool = True) -> int:
        """Parameter tensors outside the blocks on a stage holding the embedding (``first``) and/or the head
        (``last``): token and position tables, the final norm's weight (and bias), the head's weight unless tied."""
        embedding = 1 + (1 if self.learned_positions else 0)
        head = (2 if self.bias else 1) + (0 if self.tie_embeddings and first else 1)
        return (embedding if first else 0) + (head if last else 0)

    def embedding_params(self, tp: int = 1) -> int:
        """Token table (vocab-parallel: / tp) and position table (replicated)."""
        positions = self.block_size * self.n_embd if self.learned_positions else 0
        return self.vocab_size * self.n_embd // tp + positions

    def head_params(self, tp: int = 1, *, separate_stage: bool = False) -> int:
        """Final LayerNorm plus the vocabulary projection (absent when tied, unless it lives on another stage)."""
        ln = 2 * self.n_embd if self.bias else self.n_embd
        own_weight = not self.tie_embeddings or separate_stage
        return ln + (self.vocab_size * self.n_embd // tp if own_weight else 0)

    def total_params(self) -> int:
        """All parameters, a tied weight counted once."""
        return self.n_layer * self.block_params() + self.embedding_params() + self.head_params()

    def largest_layer_params(self) -> int:
        """Parameters of the largest single module: the token embedding or the MLP's first linear."""
        h, f = self.n_embd, self.ffn_dim
        widest = f * h + (f if self.bias else 0)  # the MLP's first linear (gate and up are two under SwiGLU)
        positions = self.block_size * h if self.learned_positions else 0
        return max(self.vocab_size * h, widest, positions)

    def stage_params(self, *, pp: int, tp: int) -> int:
        """Parameters on the busiest (pipeline stage, tp rank): ceil(L/pp) blocks plus embedding and/or head."""
        blocks = math.ceil(self.n_layer / pp) * self.block_params(tp)
        if pp == 1:
            return blocks + self.embedding_params(tp) + self.head_params(tp)
        first = blocks + self.embedding_params(tp)
        last = blocks + self.head_params(tp, separate_stage=True)
        return max(first, last)


@dataclass(frozen=True)
class ModelSpec:
    """A model as the planner sees it: a parameter count, its largest layer, and a shape when one is known."""

    n_params: int
    """Total parameters (Psi)."""
    largest_layer_params: int | None
    """Parameters of the largest single layer (what one device must hold at once under ZeRO-3); None = unknown."""
    shape: ModelShape | None = None
    """The GPT shape, when known: needed for activations, pipeline splits and recipes."""
    name: str = "model"
    """How the report names it."""

    @classmethod
    def from_params(cls, n_params: int, *, largest_layer_params: int | None = None, name: str = "") -> ModelSpec:
        """A bare count; the largest layer stays unknown (assumed to fit, as the report says) unless given."""
        if n_params < 1:
            raise ValueError(f"--params={n_params} must be at least 1, e.g. 7.5e9.")
        return cls(n_params=n_params, largest_layer_params=largest_layer_params, name=name or "model")

    @classmethod
    def from_shape(cls, shape: ModelShape, *, largest_layer_params: int | None = None, name: str = "") -> ModelSpec:
        largest = largest_layer_params if largest_layer_params is not None else shape.largest_layer_params()
        label = name or f"GPT L={shape.n_layer} h={shape.n_embd} a={shape.n_head} V={shape.vocab_size}"
        return cls(n_params=shape.total_params(), largest_layer_params=largest, shape=shape, name=label)

    def params_per_device(self, *, pp: int = 1, tp: int = 1) -> int:
        """Parameters one (pp, tp) rank holds before ZeRO: the busiest stage of the shape, else ceil(Psi/(pp tp))."""
        if self.shape is not None:
            return self.shape.stage_params(pp=pp, tp=tp)
        return math.ceil(self.n_params / (pp * tp))

    def largest_layer_per_device(self, *, tp: int = 1) -> int:
        """The largest layer's share on one tp rank (TP splits every large matrix); 0 when unknown."""
        return math.ceil(self.largest_layer_params / tp) if self.largest_layer_params else 0


def _gpt3(n_layer: int, n_embd: int, n_head: int) -> ModelShape:
    return ModelShape(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, vocab_size=50304, block_size=2048, tie_embeddings=True
    )


MODEL_PRESETS: dict[str, ModelShape] = {
    # GPT-2 small (Radford et al. 2019), vocabulary padded from 50257 to 50304.
    "gpt2-124m": ModelShape(n_layer=12, n_embd=768, n_head=12, vocab_size=50304, block_size=1024, tie_embeddings=True),
    # GPT-3 family, Brown et al. 2020, Table 2.1 (13B: h=5120, the paper's 5140 does not split into 40 heads).
    "gpt3-125m": _gpt3(12, 768, 12),
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-760m": _gpt3(24, 1536, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),
}
"""Named shapes for ``--model``."""

_GPT_DEFAULTS: dict[str, Any] = {
    "n_layer": 4,
    "n_head": 4,
    "n_embd": 128,
    "block_size": 128,
    "vocab_size": 256,
    "dropout": 0.0,
    "bias": True,
    "tie_embeddings": False,
}  # lightning_parallel.models.GPT's own defaults


def load_recipe(path: str | Path) -> tuple[ModelShape, dict[str, Any]]:
    """Read a recipe's model section (GPT init args) and the hints the planner uses from the rest of it.

    The recipe is read as the CLI reads it: its ``defaults`` fragments merged in and its ``${...}`` interpolations
    resolved. Returns the shape and ``{"batch_per_replica", "seq_len", "precision", "trainer",
    "accumulate_grad_batches", "global_batch_size"}`` where the recipe sets them, and ``"recipe"``: the composed
    recipe itself (``batch_per_replica``: the data
    module's ``batch_size``, sequences per data-parallel rank and step, which a pipeline splits into micro-batches;
    ``trainer``: its ``accelerator``, ``devices`` and ``num_nodes``, what the hardware is found for when no
    ``--hardware``/``--gpu-memory`` is given; the accumulation: the trainer's, and the ``parallel`` section's
    ``global_batch_size``).
    """
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--recipe {str(path)!r}: no such file. Give the path of a recipe YAML.")
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from lightning_parallel.recipe_files import compose_recipe, read_yaml

    data = read_yaml(file) or {}  # a syntax error: LayoutError (a ValueError) with the line and column
    if not isinstance(data, dict):
        raise ValueError(f"--recipe {str(path)!r} must be a mapping at the top level, not a {type(data).__name__}.")
    # as the CLI reads it: the `defaults` fragments merged in, then the ${...} interpolations resolved
    try:
        resolved: Any = OmegaConf.to_container(OmegaConf.create(compose_recipe(file)), resolve=True)
        data = resolved if isinstance(resolved, dict) else {}
    except OmegaConfBaseException as err:
        first = str(err).strip().splitlines()[0]
        raise ValueError(f"--recipe {str(path)!r}: an interpolation does not resolve ({first}). Fix the recipe "
                         "(`lightning-parallel check --config RECIPE` shows it as fit reads it).") from None
    model = data.get("model") or {}
    args = dict(model.get("init_args") or {})
    shape_args = {k: args.get(k, v) for k, v in _GPT_DEFAULTS.items()}
    shape = ModelShape(**shape_args)
    hints: dict[str, Any] = {}
    data_args = (data.get("data") or {}).get("init_args") or {}
    if "batch_size" in data_args:
        hints["batch_per_replica"] = int(data_args["batch_size"])
    hints["seq_len"] = int(data_args.get("block_size", shape.block_size))
    trainer = data.get("trainer") or {}
    precision = trainer.get("precision")
    if precision is not None:
        hints["precision"] = str(precision)
    hints["trainer"] = {k: trainer[k] for k in ("accelerator", "devices", "num_nodes") if k in trainer}
    if trainer.get("accumulate_grad_batches") is not None:
        hints["accumulate_grad_batches"] = int(trainer["accumulate_grad_batches"])
    parallel = data.get("parallel")  # a mapping, or `auto` (lp_auto)
    if isinstance(parallel, dict):  # its keys' names as fit reads them (the values are the plan's to choose)
        from lightning_parallel.config import LayoutError, ParallelConfig, unknown_key_message

        unknown = [k for k in parallel if k not in ParallelConfig.field_names()]
        if unknown:
            raise LayoutError(unknown_key_message(str(unknown[0])))
    if isinstance(parallel, dict) and parallel.get("global_batch_size") is not None:
        hints["global_batch_size"] = int(parallel["global_batch_size"])
    hints["recipe"] = data  # the whole recipe as fit reads it: a written recipe keeps what the plan does not decide
    return shape, hints
