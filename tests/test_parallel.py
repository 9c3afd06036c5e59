"""Layout search, step-time model and GPU-hours against hand-computed values and the plan."""

from __future__ import annotations

import pytest
from archs import small_arch

from collapse import memory
from collapse.config import load_config
from collapse.parallel import (
    GIB,
    LayoutError,
    Network,
    choose_layout,
    cpu_layout,
    gpu_hours,
    step_time,
    wall_time_hours,
)
from collapse.plan import plan_family

N_SMALL = 108_544  # tests/test_scaling.py: the small architecture's parameters
# round numbers for hand arithmetic: 1e12 FLOP/s per GPU at MFU 0.5, 1 GB/s links, no latency
SLOW = Network(
    peak_flops=1e12,
    mfu=0.5,
    tp_bandwidth_gbs=1.0,
    dp_bandwidth_gbs=1.0,
    min_dp_efficiency=0.5,
    min_efficiency=0.1,
    latency_s=0.0,
)
FAST = Network(peak_flops=1e12, mfu=0.5, tp_bandwidth_gbs=1e6, dp_bandwidth_gbs=1e6, latency_s=0)
FPT = 1e6  # FLOPs per token


def _step(**kw):
    args = dict(
        flops_per_token=FPT,
        batch_seqs=64,
        tp=1,
        pp=1,
        dp=1,
        micro_batch_seqs=1,
        recompute="none",
        params_on_rank=N_SMALL,
        gpus_per_node=8,
    )
    return step_time(small_arch(), SLOW, **(args | kw))


def test_step_time_by_hand():
    # 64 x 32 tokens x 1e6 FLOPs / (1 GPU x 0.5e12) = 4.096 ms, nothing else on one GPU
    assert _step() == pytest.approx((4.096e-3, 1.0))
    assert _step(recompute="full")[0] == pytest.approx(4.096e-3 * 4 / 3)
    # dp 2 within a node: 2.048 ms + (1/2) x 6 bytes x N / 1 GB/s = 0.325632 ms
    seconds, dp_eff = _step(dp=2)
    assert seconds == pytest.approx(2.048e-3 + 0.5 * 6 * N_SMALL / 1e9)
    assert dp_eff == pytest.approx(2.048e-3 / seconds)
    # pp 2, 64 micro-batches: bubble 1/65; two sends of s b h x 2 bytes per micro-batch
    seconds, _ = _step(pp=2)
    assert seconds == pytest.approx(2.048e-3 * 65 / 64 + 2 * 64 * 32 * 64 * 2 / 1e9)
    # tp 2: 4 all-reduces per layer and micro-batch of 4096 bytes, each moving half of them
    seconds, _ = _step(tp=2)
    assert seconds == pytest.approx(2.048e-3 + 64 * 2 * 4 * 4096 / 1e9)


def _choose(arch=None, network=FAST, **kw):
    args = dict(
        batch_seqs=64,
        flops_per_token=FPT,
        gpus_per_node=8,
        gpu_mem_bytes=80 * GIB,
        max_nodes=4,
        network=network,
    )
    return choose_layout(arch or small_arch(), **(args | kw))


def test_fastest_layout_takes_the_gpu_cap_when_links_are_free():
    layout = _choose()
    assert layout.gpus == 32 and layout.nodes == 4 and layout.procs_per_node == 8
    assert layout.micro_batch_seqs * layout.grad_accum * layout.dp == 64
    assert layout.limit == "the GPU cap (32)"
    assert all(c.step_seconds >= layout.step_seconds for c in layout.runners_up)
    assert layout.runners_up, "the report shows runners-up"


def test_data_parallel_efficiency_floor_bounds_the_gpus():
    layout = _choose(network=SLOW)
    seconds, dp_eff = _step(
        tp=layout.tp,
        pp=layout.pp,
        dp=layout.dp,
        micro_batch_seqs=layout.micro_batch_seqs,
        params_on_rank=memory.max_rank_params(small_arch(), tp=layout.tp, pp=layout.pp),
    )
    assert seconds == pytest.approx(layout.step_seconds)
    assert dp_eff >= SLOW.min_dp_efficiency
    assert layout.gpus == 32  # at a floor of 50 % the cap is reached
    strict = _choose(network=Network(**(SLOW.__dict__ | {"min_dp_efficiency": 0.95})))
    assert strict.gpus < 32
    assert strict.limit.startswith("efficiency: on more GPUs")


def test_memory_forces_model_parallelism_and_nothing_chosen_exceeds_it():
    a = small_arch()
    one = memory.estimate(a, tp=1, pp=1, dp=1, micro_batch_seqs=1, grad_accum=4).total
    usable = int(0.9 * one)  # one GPU at micro-batch 1 does not fit
    layout = _choose(batch_seqs=4, gpu_mem_bytes=int(usable / 0.85), max_nodes=1)
    assert layout.tp * layout.pp > 1 or layout.recompute == "full"
    for c in (layout, *layout.runners_up):
        assert c.memory.total <= usable


def test_no_fit_names_the_closest_layout_and_the_largest_tp_pp():
    with pytest.raises(LayoutError) as error:
        _choose(batch_seqs=4, gpu_mem_bytes=10_000, gpus_per_node=2, max_nodes=2)
    message = str(error.value)
    for part in ("the closest layout, tp=2 pp=2", "GiB per GPU", "usable", "max_nodes"):
        assert part in message
    assert "exceeds the GPU even at the largest TP x PP the GPUs allow (2 x 2)" in message
    with pytest.raises(ValueError, match="max_nodes must be a positive integer, got 0"):
        _choose(max_nodes=0)
    with pytest.raises(ValueError, match="mem_headroom"):
        _choose(mem_headroom=1.5)


def test_celerity_on_slurm_h100_within_a_week_and_sizes_ordered():
    plan = plan_family(load_config(["family=celerity", "cluster=slurm_h100"]), 10**13)
    t = plan.table
    assert t.wall_hours.max() < 7 * 24
    assert (t.memory_gb_per_gpu <= 0.85 * 80).all()
    for spec in plan.runs:
        p = spec.parallel
        assert p.micro_batch_seqs * p.grad_accum * p.dp == spec.optim.batch_seqs
        assert p.gpus <= 32 * 8 and (p.gpus <= 8 or p.gpus % 8 == 0)
        assert spec.model.n_heads % p.tp == 0 and spec.model.n_layers % p.pp == 0
    # a size on fewer GPUs than a smaller one says why, in the plan report
    gpus = t[t.role == "family"].groupby("size", sort=False).gpus.first()
    report = plan.report_layouts()
    for i, size in enumerate(gpus.index):
        if (gpus.iloc[:i] > gpus.iloc[i]).any():
            assert f"- {size} runs on fewer GPUs than a smaller size" in report


def test_cpu_layout():
    layout = cpu_layout(small_arch(), batch_seqs=16, procs=2)
    assert (layout.tp, layout.pp, layout.dp, layout.gpus, layout.procs_per_node) == (1, 1, 2, 0, 2)
    assert (layout.micro_batch_seqs, layout.grad_accum) == (8, 1)
    assert layout.memory.weights == 4 * N_SMALL  # fp32 on CPU
    small_micro = cpu_layout(small_arch(), batch_seqs=16, procs=2, max_micro_batch=3)
    assert (small_micro.micro_batch_seqs, small_micro.grad_accum) == (2, 4)
    with pytest.raises(LayoutError, match="procs=3"):
        cpu_layout(small_arch(), batch_seqs=16, procs=3)


def test_gpu_hours_and_wall_time():
    # 1e21 / (989e12 x 0.4) = 2.5278e6 s = 702.2 GPU-hours; on 8 GPUs 87.77 h
    assert gpu_hours(1e21, 989e12, 0.4) == pytest.approx(702.16, abs=0.01)
    assert wall_time_hours(1e21, 8, 989e12, 0.4) == pytest.approx(87.77, abs=0.01)
    assert wall_time_hours(1e21, 8, 989e12, 0.4, 0.5) == pytest.approx(175.54, abs=0.01)
    with pytest.raises(ValueError, match="mfu"):
        gpu_hours(1e21, 989e12, 0.0)
    with pytest.raises(ValueError, match="gpus"):
        wall_time_hours(1e21, 0, 989e12, 0.4)


def test_plan_time_errors_name_the_size_the_closest_layout_and_the_gpu_cap():
    from collapse.config import ConfigError

    small_gpus = ["family=celerity", "cluster=slurm_h100", "cluster.gpu_mem_gb=4"]
    with pytest.raises(ConfigError) as error:
        plan_family(load_config(small_gpus), 10**13)
    message = str(error.value)
    assert "cluster 'slurm_h100': size 300M:" in message
    assert "the closest layout, tp=2 pp=13" in message
    assert "even at the largest TP x PP the GPUs allow" in message
    for bad in ("cluster.max_nodes=0", "cluster.max_nodes=-2"):
        with pytest.raises(ConfigError, match="cluster.max_nodes: Input should be greater than 0"):
            load_config(["family=celerity", "cluster=slurm_h100", bad])
    with pytest.raises(ConfigError, match="gpus_per_node >= 1"):
        load_config(["family=celerity", "cluster=slurm_h100", "cluster.gpus_per_node=0"])


def test_cpu_layout_over_nodes_with_tensor_and_pipeline_parallel():
    # 4 processes on 2 nodes, TP 2: DP 2, each rank 16 / 2 = 8 sequences
    layout = cpu_layout(small_arch(), batch_seqs=16, procs=4, nodes=2, tp=2)
    assert (layout.tp, layout.pp, layout.dp, layout.nodes, layout.procs_per_node) == (
        2,
        1,
        2,
        2,
        2,
    )
    assert layout.micro_batch_seqs * layout.grad_accum * layout.dp == 16
    piped = cpu_layout(small_arch(), batch_seqs=16, procs=4, nodes=2, pp=2)
    assert (piped.tp, piped.pp, piped.dp) == (1, 2, 2)
    with pytest.raises(LayoutError, match="nodes_per_run=2"):
        cpu_layout(small_arch(), batch_seqs=16, procs=3, nodes=2)
    with pytest.raises(LayoutError, match="tp x pp = 4"):
        cpu_layout(small_arch(), batch_seqs=16, procs=2, tp=2, pp=2)
