"""Context parallelism's token weighing, pure logic: each cp rank's share of the counted tokens, the weighed loss
(a rank that counts nothing contributes 0 and a zero gradient), and the plan's ``labels`` key."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_parallel.config import LayoutError
from lightning_parallel.parallel.context_parallel import (
    SequenceShard,
    batch_token_share,
    counted_tokens,
    labels_of,
    loss_labels,
    read_plan,
    shard_sequence,
    split_batch,
    token_share,
    weigh,
)


class _Model(nn.Module):
    def __init__(self, plan: dict[str, Any]) -> None:
        super().__init__()
        self.core = nn.Identity()
        self.plan = plan

    def context_parallel_plan(self) -> dict[str, Any]:
        return {"attention": ["core"], "batch": {0: 1, 1: 1}, **self.plan}


@pytest.mark.parametrize("cp", [2, 4])
def test_weighed_token_means_over_cp_are_the_whole_sequences_token_mean(cp: int) -> None:
    """For random logits and labels with ignored prompts and padding, the mean over the cp ranks of
    ``share x (the rank's token mean)`` equals the cross-entropy over the whole batch; the plain mean does not."""
    g = torch.Generator().manual_seed(0)
    b, s, v = 3, 8 * cp, 11
    logits = torch.randn(b, s, v, generator=g)
    labels = torch.randint(0, v, (b, s), generator=g)
    labels[0, -3 * s // 4:] = -100  # padding: mostly in the tail chunks
    labels[1, : s // 2] = -100  # a masked prompt: the head chunks
    whole = F.cross_entropy(logits.reshape(-1, v), labels.reshape(-1))
    plan = read_plan(_Model({"labels": 1}))
    weighed, plain = [], []
    for r in range(cp):
        shard = SequenceShard(cp, r)
        x, y = split_batch((logits, labels), plan, shard)
        loss = F.cross_entropy(x.reshape(-1, v), y.reshape(-1))
        share = batch_token_share((logits, labels), plan, shard)
        assert share is not None
        weighed.append(weigh(loss, share))
        plain.append(loss)
    assert torch.allclose(torch.stack(weighed).mean(), whole, atol=1e-6)
    assert not torch.allclose(torch.stack(plain).mean(), whole, atol=1e-3)


def test_token_share_sums_to_cp_and_is_one_when_nothing_counts() -> None:
    counts = torch.tensor([0, 5, 3, 8])
    total = counts.sum()
    shares = [token_share(c, total, 4) for c in counts]
    assert torch.isclose(torch.stack(shares).sum(), torch.tensor(4.0))
    assert float(shares[0]) == 0.0
    assert float(token_share(torch.tensor(0), torch.tensor(0), 2)) == 1.0  # nothing counted: one device's NaN stays


def test_a_rank_that_counts_nothing_gives_zero_and_a_zero_gradient() -> None:
    logits = torch.randn(2, 4, 5, requires_grad=True)
    labels = torch.full((2, 4), -100)
    loss = F.cross_entropy(logits.reshape(-1, 5), labels.reshape(-1))
    assert loss.isnan()
    out = weigh(loss, token_share(torch.tensor(0), torch.tensor(6), 2))
    assert float(out.detach()) == 0.0
    out.backward()
    assert logits.grad is not None and torch.equal(logits.grad, torch.zeros_like(logits))
    # a non-finite loss of a rank that counts tokens stays non-finite (the non-finite guard must see it)
    assert weigh(torch.tensor(float("nan")), torch.tensor(1.5)).isnan()


def test_batch_token_share_counts_the_head_and_tail_chunks() -> None:
    labels = torch.arange(8).repeat(2, 1)
    labels[:, 6:] = -100  # cp2 chunks of 2: rank 0 holds positions 0 1 6 7, rank 1 positions 2 3 4 5
    plan = read_plan(_Model({"labels": 1}))
    shares = [batch_token_share((labels, labels), plan, SequenceShard(2, r)) for r in (0, 1)]
    assert [round(float(x), 6) for x in shares if x is not None] == [round(2 * 4 / 12, 6), round(2 * 8 / 12, 6)]
    assert torch.equal(shard_sequence(labels, 1, SequenceShard(2, 0))[0], torch.tensor([0, 1, -100, -100]))
    assert batch_token_share((labels, labels), read_plan(_Model({})), SequenceShard(2, 0)) is None
    custom = read_plan(_Model({"labels": 1, "ignore_index": 7}))
    assert custom.ignore_index == 7 and custom.labels == 1


@pytest.mark.parametrize(("plan", "message"), [
    ({"labels": 2}, "'labels' names batch entry 2, which 'batch' ({0: 1, 1: 1}) does not split"),
    ({"labels": 1, "ignore_index": 1.5}, "'ignore_index' must be an int"),
    ({"ignore_index": -1}, "'ignore_index' must be an int (the label a token mean does not count, -100 for "
                           "F.cross_entropy) given with 'labels'"),
    ({"label": 1}, "optionally 'labels' (the batch entry of the token labels, or a function of the batch "
                      "returning them), 'ignore_index' and 'unsplit_attention'"),
    ({"unsplit_attention": "xattn"}, "'unsplit_attention' must be a list of submodule names or patterns"),
])
def test_the_labels_keys_are_checked(plan: dict[str, Any], message: str) -> None:
    with pytest.raises(LayoutError) as err:
        read_plan(_Model(plan))
    assert message in str(err.value)


def _shifted(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.pad(batch["labels"][..., 1:], (0, 1), value=-100)


def test_labels_given_as_a_function_are_counted_as_the_loss_sees_them_and_refused_under_cp() -> None:
    """A loss that shifts its labels inside names them by a function of the batch: the count is the function's
    labels' (not the batch entry's); a function that fails or returns no integer tensor is named in the error; cp
    (which cuts the labels along the sequence) refuses it with the fix."""
    labels = torch.tensor([[-100, 5, 6, -100], [7, 8, 9, 10]])
    batch = {"input_ids": labels.clamp(min=0), "labels": labels}
    plan = loss_labels(_Model({"labels": _shifted}))
    assert plan is not None and plan.labels is _shifted
    assert torch.equal(labels_of(batch, plan), torch.tensor([[5, 6, -100, -100], [8, 9, 10, -100]]))
    assert int(counted_tokens(batch, plan)) == 5 and int((labels != -100).sum()) == 6
    with pytest.raises(ValueError, match=r"the function _shifted, raised KeyError: 'labels' on a batch \(dict\)"):
        labels_of({"input_ids": labels}, plan)
    floats = loss_labels(_Model({"labels": lambda b: b["labels"].float()}))
    assert floats is not None
    with pytest.raises(ValueError, match=r"the function .*<lambda> returns torch.float32, not integer token labels"):
        labels_of(batch, floats)
    with pytest.raises(LayoutError, match=r"'labels' is a function \(_shifted\).*Fix: name the entry of the labels"):
        read_plan(_Model({"labels": _shifted}))


def test_the_step_weight_is_exactly_one_where_every_batch_counts_as_many_tokens() -> None:
    """dp 2, windows of 2 batches: a rank's weight ``dp n k / N_step`` in one division -- exactly 1.0 for uniform
    counts (so the loss is Lightning's bit for bit), the token share otherwise, 0 where nothing is counted."""
    from lightning_parallel.strategies.logged import TokenWeights

    for n in (60, 61, 8184, 12345):
        weights = TokenWeights(local=torch.tensor(n) * 2, count=torch.tensor(n), window=torch.tensor([2.0 * n]),
                               accumulation=2, dp=2)
        summed = torch.tensor([2.0 * n, 4.0 * n])  # both ranks' batch and window counts
        assert weights.loss_weight(summed).item() == 1.0
        loss = torch.tensor(3.7)
        assert torch.equal(loss * weights.loss_weight(summed), loss)
    uneven = TokenWeights(local=torch.tensor(30) * 2, count=torch.tensor(30), window=torch.tensor([70.0]),
                          accumulation=2, dp=2)
    assert abs(uneven.loss_weight(torch.tensor([100.0, 200.0])).item() - 2 * 30 * 2 / 200) < 1e-7
    empty = TokenWeights(local=torch.tensor(0), count=torch.tensor(0), window=torch.tensor([0.0]), accumulation=2,
                         dp=2)
    assert empty.loss_weight(torch.tensor([0.0, 0.0])).item() == 0.0
