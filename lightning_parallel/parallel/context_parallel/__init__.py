"""Context parallelism: a sequence split over the ``cp`` ranks, attention computed exactly across them.

* :mod:`.sharding` -- the head-tail split (rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``), the
  process's active split and :func:`sequence_positions` for position embeddings;
* :mod:`.ring` -- :func:`ring_attention`: key/value blocks passed around the cp ranks point to point, exact
  online-softmax merge, backward over the same ring (``context_parallel_style: ring``);
* :mod:`.ulysses` -- :func:`all_to_all_attention`: heads <-> sequence by all-to-alls around a local attention
  (``context_parallel_style: all_to_all``);
* :mod:`.plan` -- a module's ``context_parallel_plan()``: its attention submodules routed to the above, its batch
  tensors split along their sequence dims (the composition's ``context parallel`` step,
  :func:`~lightning_parallel.parallel.compose.apply_context_parallel_step`), and a token-mean loss weighed by each
  rank's share of the counted tokens (:func:`batch_token_share`).

No Lightning import.
"""

from .plan import (
    MINIMAL_PLAN,
    ContextParallelPlan,
    apply_context_parallel,
    batch_token_share,
    check_context_plan,
    context_parallel_modules,
    counted_tokens,
    describe_labels,
    labels_of,
    loss_labels,
    read_plan,
    split_batch,
    split_length,
    token_share,
    unrouted_attention_check,
    unsplit_sequences,
    weigh,
)
from .ring import ring_attention
from .sharding import (
    ContextParallelState,
    SequenceShard,
    activate,
    activated,
    active,
    deactivate,
    head_tail_order,
    sequence_length,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
)
from .ulysses import all_to_all_attention

__all__ = ["MINIMAL_PLAN", "ContextParallelPlan", "ContextParallelState", "SequenceShard", "activate", "activated",
           "active", "all_to_all_attention", "apply_context_parallel", "batch_token_share", "check_context_plan",
           "context_parallel_modules", "counted_tokens", "deactivate", "describe_labels", "head_tail_order",
           "labels_of", "loss_labels", "read_plan", "ring_attention", "sequence_length", "sequence_positions",
           "shard_sequence", "split_batch", "split_length", "token_share", "unrouted_attention_check",
           "unshard_sequence", "unsplit_sequences", "weigh"]
