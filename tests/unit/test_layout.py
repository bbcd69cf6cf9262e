"""The layout: every bad layout is refused before any process starts, with the key, the arithmetic and the fix."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest

from lightning_parallel import LayoutError, LPDDPStrategy, ParallelConfig, ParallelDims, check_model_compat

# (layout, world size, devices per node, num_nodes, words the message must contain)
BAD_LAYOUTS: list[tuple[dict[str, Any], int, int, int, tuple[str, ...]]] = [
    ({"data_parallel_size": 3}, 2, 2, 1, ("data_parallel_size (3)", "= 3", "world size is 2", "Fix")),
    ({"data_parallel_size": 0}, 2, 2, 1, ("data_parallel_size", "positive integer")),
    ({"data_parallel_size": "two"}, 2, 2, 1, ("data_parallel_size", "'auto'")),
    ({"pipeline_parallel_size": 0}, 2, 2, 1, ("pipeline_parallel_size",)),
    ({"tensor_parallel_size": -1}, 2, 2, 1, ("tensor_parallel_size",)),
    ({"tensor_parallel_size": 3}, 4, 4, 1, ("tensor_parallel_size (3)", "4 % 3 = 1", "Fix")),
    ({"data_parallel_size": 2, "tensor_parallel_size": 2}, 8, 8, 1, ("= 4", "world size is 8", "data_parallel_size=4")),
    ({"tensor_parallel_size": 4}, 8, 2, 4, ("tensor_parallel_size (4)", "one node (2)")),
    ({"zero_stage": 4}, 2, 2, 1, ("zero_stage", "[0, 1, 2, 3]")),
    ({"zero_stage": 3, "data_parallel_shard_size": 3}, 4, 4, 1, ("data_parallel_shard_size=3", "4 % 3 = 1", "Fix")),
    ({"offload": "gpu"}, 2, 2, 1, ("offload", "'cpu'")),
    ({"offload": "cpu", "zero_stage": 1}, 2, 2, 1, ("offload='cpu'", "zero_stage=1", "zero_stage=2")),
    ({"offload": "nvme", "zero_stage": 3}, 2, 2, 1, ("nvme_path",)),
    ({"nvme_path": "/tmp/x", "offload": "cpu", "zero_stage": 2}, 2, 2, 1, ("nvme_path", "offload='nvme'")),
    ({"pipeline_schedule": "1f2b"}, 2, 2, 1, ("pipeline_schedule", "'1f1b'")),
    ({"pipeline_parallel_size": 2, "pipeline_schedule": "interleaved_1f1b"}, 2, 2, 1,
     ("virtual_pipeline_stages", ">= 2")),
    ({"pipeline_parallel_size": 4, "num_micro_batches": 2}, 4, 4, 1, ("num_micro_batches=2", "bubble", ">= 4")),
    ({"num_micro_batches": 4}, 2, 2, 1, ("num_micro_batches=4", "pipeline_parallel_size=1")),
    ({"virtual_pipeline_stages": 2, "pipeline_schedule": "interleaved_1f1b"}, 2, 2, 1,
     ("virtual_pipeline_stages=2", "pipeline_parallel_size")),
    ({"sequence_parallel": True}, 2, 2, 1, ("sequence_parallel", "tensor_parallel_size")),
    ({"data_paralel_size": 2}, 2, 2, 1, ("data_paralel_size", "Did you mean 'data_parallel_size'")),
    ({"offload": "cpu", "zero_stage": 2, "tensor_parallel_size": 2}, 2, 2, 1, ("offload", "tensor_parallel_size=2")),
]


@pytest.mark.parametrize(("layout", "world", "per_node", "nodes", "words"), BAD_LAYOUTS,
                         ids=[str(i) for i in range(len(BAD_LAYOUTS))])
def test_bad_layout_refused_with_the_key_and_the_arithmetic(
    layout: dict[str, Any], world: int, per_node: int, nodes: int, words: tuple[str, ...]
) -> None:
    with pytest.raises(LayoutError) as err:
        config = ParallelConfig.from_dict(layout)
        ParallelDims.from_config(config, world_size=world, devices_per_node=per_node, num_nodes=nodes)
    for word in words:
        assert word in str(err.value), f"{word!r} missing from: {err.value}"


def test_at_least_fifteen_bad_layouts() -> None:
    assert len(BAD_LAYOUTS) >= 15


@pytest.mark.parametrize(
    ("shape", "layout", "words"),
    [
        ({"n_head": 6}, {"tensor_parallel_size": 4}, ("n_head=6", "6 % 4 = 2", "[1, 2, 3, 6]")),
        ({"n_layer": 2}, {"pipeline_parallel_size": 4, "num_micro_batches": 4}, ("n_layer=2", "<= 2")),
        ({"vocab_size": 257}, {"tensor_parallel_size": 2}, ("vocab_size=257", "multiple of 2")),
    ],
)
def test_model_shape_rules(shape: dict[str, int], layout: dict[str, Any], words: tuple[str, ...]) -> None:
    with pytest.raises(LayoutError) as err:
        check_model_compat(ParallelConfig.from_dict(layout), **shape)
    for word in words:
        assert word in str(err.value)


def test_good_layouts_resolve_auto() -> None:
    dims = ParallelDims.from_config(ParallelConfig(pipeline_parallel_size=2, tensor_parallel_size=2,
                                                   num_micro_batches=4), world_size=8)
    assert dims.shape == (2, 2, 2)
    assert ParallelDims.from_config(ParallelConfig(), world_size=3).shape == (3, 1, 1)
    config = ParallelConfig.from_dict({"zero_stage": 1, "pipeline_parallel_size": 2})
    assert config.micro_batches == 2 and config.replace(num_micro_batches=8).micro_batches == 8


def test_trainer_refuses_a_bad_layout_in_its_constructor() -> None:
    """Trainer.__init__ resolves the layout (configure_launcher): nothing is spawned, the message has the sizes."""
    with pytest.raises(LayoutError, match=r"data_parallel_size \(3\).*world size is 2 \(devices=2 per node"):
        pl.Trainer(strategy=LPDDPStrategy(parallel={"data_parallel_size": 3}), accelerator="cpu", devices=2)


def test_lp_ddp_refuses_non_data_parallel_layouts() -> None:
    with pytest.raises(LayoutError, match=r"tensor_parallel_size=2\. Fix: .* or use strategy lp_tensor"):
        LPDDPStrategy(parallel={"tensor_parallel_size": 2})
    with pytest.raises(LayoutError, match=r"nvme_path.*offload='nvme'"):
        LPDDPStrategy(parallel={"nvme_path": "/tmp/x"})  # "not set" is lp_ddp's "none": nvme_path has no use
    with pytest.raises(LayoutError, match=r"parallel.zero_stage=1.*lp_sharded"):
        LPDDPStrategy(parallel={"zero_stage": 1})
    with pytest.raises(ValueError, match="comm_hook"):
        LPDDPStrategy(comm_hook="int8")  # type: ignore[arg-type]


def test_one_table_from_layout_to_strategy() -> None:
    """The layout table: plain ZeRO-3 is lp_sharded's (not the offload engine's); offload is lp_zero_offload's;
    tp layouts are lp_tensor's, pp layouts (with ZeRO 0 or 1) lp_pipeline's, pp x tp layouts lp_hybrid's."""
    from lightning_parallel.layouts import available_strategies, strategy_for, strategy_for_key

    def name(**keys: Any) -> str:
        return strategy_for(ParallelConfig.from_dict(keys))

    assert name() == "lp_ddp" and name(zero_stage=0, offload="none") == "lp_ddp"
    assert [name(zero_stage=z) for z in (1, 2, 3)] == ["lp_sharded"] * 3
    assert name(zero_stage=2, offload="cpu") == name(zero_stage=3, offload="nvme", nvme_path="/x") == "lp_zero_offload"
    assert name(pipeline_parallel_size=2) == "lp_pipeline" and name(tensor_parallel_size=2) == "lp_tensor"
    assert name(pipeline_parallel_size=2, tensor_parallel_size=2, zero_stage=1) == "lp_hybrid"
    assert available_strategies() == ["lp_ddp", "lp_sharded", "lp_zero_offload", "lp_pipeline", "lp_tensor",
                                      "lp_hybrid"]
    assert name(pipeline_parallel_size=2, zero_stage=1) == "lp_pipeline"
    assert strategy_for_key("pipeline_parallel_size") == "or use strategy lp_pipeline or lp_hybrid"
    assert strategy_for_key("offload") == "or use strategy lp_zero_offload"


def test_unset_and_explicit_differ() -> None:
    """None is "not set" (the strategy's preset decides); an explicit value is kept as written."""
    unset = ParallelConfig()
    assert unset.zero_stage is None and unset.offload is None and unset.zero == 0 and unset.offload_device == "none"
    assert unset.with_preset(zero_stage=2, offload="cpu").to_dict() == {**unset.to_dict(), "zero_stage": 2,
                                                                       "offload": "cpu"}
    explicit = ParallelConfig(zero_stage=0, offload="none")
    assert explicit.with_preset(zero_stage=2, offload="cpu") == explicit


def test_cpu_oversubscription_is_warned_about() -> None:
    """More CPU ranks than cores trains exactly but at a crawl: the launch says so (GPU ranks never warn)."""
    from lightning_parallel.strategies.layout import oversubscription_warning

    text = oversubscription_warning(processes=8, device_type="cpu", cores=2)
    assert text is not None and "8 processes on this node's 2 CPU core(s)" in text and "devices <= 2" in text
    assert oversubscription_warning(processes=2, device_type="cpu", cores=2) is None
    assert oversubscription_warning(processes=8, device_type="cuda", cores=2) is None
    assert oversubscription_warning(processes=8, device_type="cpu", cores=None) is None


def test_schedule_names_have_one_source() -> None:
    """config.SCHEDULES names every schedule once; the PipelineSchedule type (for the CLI and type checkers) agrees."""
    from typing import get_args

    from lightning_parallel.config import SCHEDULES, PipelineSchedule

    assert tuple(SCHEDULES) == get_args(PipelineSchedule)
    assert all(name == info.name for name, info in SCHEDULES.items())



def test_every_strategy_refuses_exactly_what_its_row_of_the_table_does_not_run() -> None:
    """The refusals come from the layout table: over a grid of layouts, each strategy of the table accepts a layout
    (with its preset filled in) exactly when its row runs it, and a refusal names the strategy that runs it."""
    import itertools

    from lightning_parallel.layouts import LAYOUT_STRATEGIES, entry, strategy_for
    from lightning_parallel.strategies import STRATEGIES

    checked = 0
    for pp, tp, zero, offload in itertools.product((1, 2), (1, 2), (None, 0, 1, 2, 3), (None, "none", "cpu")):
        try:
            layout = ParallelConfig(pipeline_parallel_size=pp, tensor_parallel_size=tp, zero_stage=zero,
                                    offload=offload, num_micro_batches=pp if pp > 1 else None)
        except LayoutError:
            continue  # the layout's own rules (config.py), not the table's
        for row in LAYOUT_STRATEGIES:
            cls = STRATEGIES[row.name][0]
            try:
                filled = layout.with_preset(**cls().preset)
            except LayoutError:
                continue  # the preset meets the layout's own rules
            try:
                cls(layout)
            except LayoutError as err:
                refused: str | None = str(err)
            else:
                refused = None
            if row.runs(filled):
                assert refused is None, (row.name, layout.describe(), refused)
                continue
            assert refused is not None and refused.startswith(row.name), (row.name, layout.describe(), refused)
            runner = strategy_for(filled)
            if runner != row.name and entry(runner).runs(filled):
                assert runner in refused, (row.name, layout.describe(), refused)
            checked += 1
    assert checked > 30


def test_finetuning_callbacks_are_refused_where_they_cannot_run() -> None:
    """Lightning's BaseFinetuning callbacks read the optimizer's param groups parameter by parameter: refused before
    launch (and again in the rank, for callbacks a module's ``configure_callbacks()`` adds) under the flat ZeRO-1/2
    optimizers -- whatever the layout that picks them, a shard size equal to dp included -- and tensor parallelism;
    let run where the module's parameters are in the param groups (DDP, FSDP2, pipelines at ZeRO 0/2)."""
    from lightning.pytorch.callbacks import BackboneFinetuning

    from lightning_parallel.strategies import LPPipelineStrategy, LPShardedStrategy, LPTensorStrategy
    from lightning_parallel.strategies.layout import check_finetuning_callbacks

    cases: list[tuple[Any, int, bool]] = [
        (LPDDPStrategy(), 2, False),
        (LPShardedStrategy({"zero_stage": 1}), 2, True),
        (LPShardedStrategy({"zero_stage": 2}), 2, True),
        (LPShardedStrategy({"zero_stage": 2, "data_parallel_shard_size": 2}), 2, True),  # not HSDP: the flat ZeRO-2
        (LPShardedStrategy({"zero_stage": 2, "data_parallel_shard_size": 2}), 4, False),  # HSDP over FSDP2
        (LPShardedStrategy({"zero_stage": 3}), 2, False),
        (LPTensorStrategy({"tensor_parallel_size": 2}), 2, True),
        (LPPipelineStrategy({"pipeline_parallel_size": 2}), 2, False),
        (LPPipelineStrategy({"pipeline_parallel_size": 2, "zero_stage": 1}), 4, True),
        (LPPipelineStrategy({"pipeline_parallel_size": 2, "zero_stage": 2}), 4, False),
    ]
    for strategy, devices, refused in cases:
        trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, callbacks=[BackboneFinetuning()],
                             logger=False, enable_checkpointing=False, enable_progress_bar=False)
        if refused:
            with pytest.raises(LayoutError, match=r"BackboneFinetuning .* cannot run under"):
                check_finetuning_callbacks(strategy, trainer)
        else:
            check_finetuning_callbacks(strategy, trainer)


def test_weight_averaging_and_overfit_runs_are_refused_where_they_cannot_run() -> None:
    """SWA / EMA (a whole copy of the module, averaged parameter by parameter) need whole live parameters: refused
    under FSDP2 (ZeRO-3), tensor and pipeline parallelism, let run under DDP and the flat ZeRO-1/2. ``overfit_batches``
    with ``use_distributed_sampler=False`` over dp > 1 would train every replica on the same batches: refused."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    from lightning_parallel.strategies import LPPipelineStrategy, LPShardedStrategy, LPTensorStrategy
    from lightning_parallel.strategies.layout import check_overfit_batches, check_weight_averaging_callbacks

    cases: list[tuple[Any, bool]] = [
        (LPDDPStrategy(), False),
        (LPShardedStrategy({"zero_stage": 1}), False),
        (LPShardedStrategy({"zero_stage": 2}), False),
        (LPShardedStrategy({"zero_stage": 3}), True),
        (LPTensorStrategy({"tensor_parallel_size": 2}), True),
        (LPPipelineStrategy({"pipeline_parallel_size": 2}), True),
    ]
    quiet: dict[str, Any] = dict(accelerator="cpu", devices=2, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False)
    for strategy, refused in cases:
        trainer = pl.Trainer(strategy=strategy, callbacks=[StochasticWeightAveraging(swa_lrs=0.01)], **quiet)
        if refused:
            with pytest.raises(LayoutError, match=r"StochasticWeightAveraging keeps a whole copy .* Fix: lp_ddp"):
                check_weight_averaging_callbacks(strategy, trainer)
        else:
            check_weight_averaging_callbacks(strategy, trainer)
    for use_sampler, devices, cp, refused in ((False, 2, 1, True), (True, 2, 1, False), (False, 1, 1, False),
                                              (False, 2, 2, False)):  # cp ranks share their batches
        strategy = LPDDPStrategy({"context_parallel_size": cp})
        trainer = pl.Trainer(strategy=strategy, overfit_batches=2, use_distributed_sampler=use_sampler,
                             **{**quiet, "devices": devices})
        if refused:
            with pytest.raises(LayoutError, match=r"overfit_batches=2 with use_distributed_sampler=False over 2"):
                check_overfit_batches(strategy, trainer)
        else:
            check_overfit_batches(strategy, trainer)
