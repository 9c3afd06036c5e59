"""Memory per GPU, layout choice and GPU-hours against hand-computed values."""

from __future__ import annotations

import pytest
from archs import small_arch

from collapse.parallel import (
    GIB,
    Layout,
    LayoutError,
    activation_bytes_per_layer,
    choose_layout,
    cpu_layout,
    gpu_hours,
    memory_per_gpu_bytes,
    stage_params,
    wall_time_hours,
)
from collapse.runspec import ModelArch
from collapse.scaling import param_count

N_SMALL = 108_544  # tests/test_scaling.py: word 6400, positions 2048, body 100096


def test_stage_params_by_hand():
    a = small_arch()
    assert param_count(a).total == N_SMALL
    assert stage_params(a, N_SMALL, pp=1) == N_SMALL
    # pp 2: first = 100096 / 2 + 6400 + 2048 = 58496; last = 50048 + 6400 (tied copy) = 56448
    assert stage_params(a, N_SMALL, pp=2) == 58_496


def test_activations_per_layer_by_hand():
    a = small_arch()
    # s 32, b 2, h 64, 2-byte: replicated 2*2*sbh + 2*2*sbh + 2*sbh = 10 sbh = 40960;
    # sharded 4*2*s*b*d_attn + 2*s*b*2f = 32768 + 65536 = 98304
    assert (
        activation_bytes_per_layer(a, micro_batch_seqs=2, tp=1, act_bytes=2, flash_attention=True)
        == 40_960 + 98_304
    )
    # Korthikanti 4h FFN: s b h (10 + 24/t) + 5 a s^2 b / t with t = 2
    s, b, h, heads, t = 32, 2, 64, 4, 2
    korthikanti = s * b * h * (10 + 24 // t) + 5 * heads * s * s * b // t
    assert (
        activation_bytes_per_layer(a, micro_batch_seqs=2, tp=2, act_bytes=2, flash_attention=False)
        == korthikanti
        == 110_592
    )


def test_memory_single_gpu_by_hand():
    m = memory_per_gpu_bytes(small_arch(), N_SMALL, tp=1, pp=1, dp=1, micro_batch_seqs=2)
    assert m.weights == 2 * N_SMALL == 217_088  # bf16
    assert m.grads == 4 * N_SMALL == 434_176  # fp32 main grads
    assert m.optimizer == 12 * N_SMALL == 1_302_528  # fp32 master + m + v
    # 2 layers x 139264 + output: 2*2*sbh + (2 + 4) s b V = 16384 + 38400
    assert m.activations == 2 * 139_264 + 54_784 == 333_312
    assert m.total == 2_287_104


def test_memory_tp2_pp2_dp2_by_hand():
    m = memory_per_gpu_bytes(
        small_arch(), N_SMALL, tp=2, pp=2, dp=2, micro_batch_seqs=2, flash_attention=False
    )
    on_gpu = 58_496 // 2  # largest stage over TP
    assert m.weights == 2 * on_gpu
    assert m.grads == 4 * on_gpu
    assert m.optimizer == 12 * on_gpu // 2  # distributed optimizer over dp 2
    # first stage: pp 2 micro-batches x 1 layer x 110592; last: 110592 + 16384 + 38400 / 2
    assert m.activations == max(2 * 110_592, 110_592 + 35_584) == 221_184
    assert m.total == 58_496 + 116_992 + 175_488 + 221_184


def test_memory_recompute_and_fp32():
    m = memory_per_gpu_bytes(
        small_arch(), N_SMALL, tp=1, pp=1, dp=4, micro_batch_seqs=2, activation_recompute=True
    )
    # layer inputs 2 x (2*32*2*64 = 8192) + one layer rebuilt 139264 + output 54784
    assert m.activations == 2 * 8_192 + 139_264 + 54_784
    assert m.optimizer == 12 * N_SMALL // 4
    fp32 = memory_per_gpu_bytes(
        small_arch(),
        N_SMALL,
        tp=1,
        pp=1,
        dp=4,
        micro_batch_seqs=2,
        param_bytes=4,
        distributed_optimizer=False,
    )
    assert fp32.weights == 4 * N_SMALL
    assert fp32.optimizer == 8 * N_SMALL  # no master copy, not sharded
    with pytest.raises(ValueError, match="pp=3"):
        memory_per_gpu_bytes(small_arch(), N_SMALL, tp=1, pp=3, dp=1, micro_batch_seqs=1)


def _fits_exactly(layout_memory_total: int, headroom: float = 0.85) -> int:
    return int(layout_memory_total / headroom) + 8


def test_choose_layout_small_model_takes_one_gpu_and_largest_micro_batch():
    layout = choose_layout(
        small_arch(), N_SMALL, batch_seqs=64, gpus_per_node=8, gpu_mem_bytes=80 * GIB, max_nodes=4
    )
    # 64 x 32 = 2048 tokens per step: below 32k per replica, so no data parallelism
    assert (layout.tp, layout.pp, layout.dp, layout.gpus, layout.nodes) == (1, 1, 1, 1, 1)
    assert (layout.micro_batch_seqs, layout.grad_accum) == (8, 8)


def test_choose_layout_data_parallel_rule():
    # at least 256 tokens (8 sequences) per replica: dp 8 of 64; dp 16 would leave 4 sequences
    layout = choose_layout(
        small_arch(),
        N_SMALL,
        batch_seqs=64,
        gpus_per_node=8,
        gpu_mem_bytes=80 * GIB,
        max_nodes=4,
        min_tokens_per_replica=256,
    )
    assert (layout.dp, layout.gpus, layout.nodes, layout.procs_per_node) == (8, 8, 1, 8)
    assert layout.micro_batch_seqs * layout.grad_accum * layout.dp == 64
    # at 64 tokens per replica: dp 32 is 4 nodes; dp 64 would need 8 nodes > max_nodes 4
    wide = choose_layout(
        small_arch(),
        N_SMALL,
        batch_seqs=64,
        gpus_per_node=8,
        gpu_mem_bytes=80 * GIB,
        max_nodes=4,
        min_tokens_per_replica=64,
    )
    assert (wide.dp, wide.gpus, wide.nodes, wide.procs_per_node) == (32, 32, 4, 8)


def test_choose_layout_prefers_tensor_parallel_when_memory_forces_it():
    a = small_arch()
    need_tp2 = memory_per_gpu_bytes(a, N_SMALL, tp=2, pp=1, dp=1, micro_batch_seqs=1).total
    need_tp1 = memory_per_gpu_bytes(a, N_SMALL, tp=1, pp=1, dp=1, micro_batch_seqs=1).total
    need_pp2 = memory_per_gpu_bytes(a, N_SMALL, tp=1, pp=2, dp=1, micro_batch_seqs=1).total
    mem = _fits_exactly(need_tp2)
    assert 0.85 * mem < need_tp1 and 0.85 * mem < need_pp2  # neither tp 1 nor pp 2 alone fits
    layout = choose_layout(
        a, N_SMALL, batch_seqs=4, gpus_per_node=8, gpu_mem_bytes=mem, max_nodes=1
    )
    assert (layout.tp, layout.pp, layout.micro_batch_seqs, layout.grad_accum) == (2, 1, 1, 4)
    assert layout.memory.total == need_tp2


def test_choose_layout_falls_back_to_pipeline_without_tp():
    a = small_arch()
    need_pp2 = memory_per_gpu_bytes(a, N_SMALL, tp=1, pp=2, dp=1, micro_batch_seqs=1).total
    # one GPU per node: TP is impossible, PP 2 spans two nodes
    layout = choose_layout(
        a,
        N_SMALL,
        batch_seqs=4,
        gpus_per_node=1,
        gpu_mem_bytes=_fits_exactly(need_pp2),
        max_nodes=2,
    )
    assert (layout.tp, layout.pp, layout.gpus, layout.nodes, layout.procs_per_node) == (
        1,
        2,
        2,
        2,
        1,
    )


def test_choose_layout_fixed_gpus_and_heads_divisibility():
    a = small_arch(n_heads=2, head_dim=32)  # TP at most 2
    layout = choose_layout(
        a, N_SMALL, batch_seqs=12, gpus_per_node=8, gpu_mem_bytes=80 * GIB, max_nodes=1, gpus=4
    )
    assert (layout.tp, layout.pp, layout.dp, layout.micro_batch_seqs, layout.grad_accum) == (
        1,
        1,
        4,
        3,
        1,
    )
    with pytest.raises(LayoutError, match="exactly 5 GPUs"):
        choose_layout(
            a, N_SMALL, batch_seqs=12, gpus_per_node=8, gpu_mem_bytes=80 * GIB, max_nodes=1, gpus=5
        )


def test_choose_layout_error_names_size_need_and_fix():
    with pytest.raises(LayoutError) as error:
        choose_layout(
            small_arch(), N_SMALL, batch_seqs=4, gpus_per_node=2, gpu_mem_bytes=10_000, max_nodes=1
        )
    message = str(error.value)
    for part in ("0.00B-parameter", "GiB per GPU", "usable", "activation recompute", "max_nodes"):
        assert part in message
    with pytest.raises(ValueError, match="mem_headroom"):
        choose_layout(
            small_arch(),
            N_SMALL,
            batch_seqs=4,
            gpus_per_node=2,
            gpu_mem_bytes=GIB,
            max_nodes=1,
            mem_headroom=1.5,
        )


def test_celerity_layouts_on_80gb_nodes(capsys):
    """docs/method.md §8 sizes on 8 x 80 GB per node, 16 nodes: every size fits."""
    sizes = [
        ("300M", 640, 10, 64, 13, 176),
        ("500M", 896, 14, 64, 17, 240),
        ("900M", 1152, 9, 128, 23, 336),
        ("1.8B", 1536, 12, 128, 30, 464),
        ("3.9B", 2048, 16, 128, 40, 672),
    ]
    rows = []
    for name, d, heads, head_dim, layers, batch in sizes:
        a = ModelArch(
            d_model=d,
            n_layers=layers,
            n_heads=heads,
            head_dim=head_dim,
            ffn_hidden=8 * d,
            activation="squared_relu",
            positions="alibi",
            vocab_size=128256,
            seq_len=8192,
            tied_embeddings=False,
        )
        n = param_count(a).total
        layout = choose_layout(
            a, n, batch_seqs=batch, gpus_per_node=8, gpu_mem_bytes=80 * GIB, max_nodes=16
        )
        assert isinstance(layout, Layout)
        assert layout.micro_batch_seqs * layout.grad_accum * layout.dp == batch
        assert heads % layout.tp == 0 and layers % layout.pp == 0
        assert layout.memory.total <= 0.85 * 80 * GIB
        assert batch // layout.dp * 8192 >= 32_768
        assert layout.gpus == layout.tp * layout.pp * layout.dp
        assert layout.gpus <= 8 or layout.gpus % 8 == 0
        rows.append(
            f"{name}: tp {layout.tp} pp {layout.pp} dp {layout.dp} micro {layout.micro_batch_seqs}"
            f" accum {layout.grad_accum} gpus {layout.gpus} "
            f"mem {layout.memory.total / GIB:.1f} GiB"
        )
    with capsys.disabled():
        print("\nCelerity layouts:\n  " + "\n  ".join(rows))
    # 300M: 176 = 16 x 11; dp 22, 44 are not whole nodes, dp 88 leaves 16k tokens < 32k
    assert rows[0].startswith("300M: tp 1 pp 1 dp 16 micro 1 accum 11 gpus 16")


def test_cpu_layout():
    layout = cpu_layout(small_arch(), N_SMALL, batch_seqs=16, procs=2)
    assert (layout.tp, layout.pp, layout.dp, layout.gpus, layout.procs_per_node) == (1, 1, 2, 0, 2)
    assert (layout.micro_batch_seqs, layout.grad_accum) == (8, 1)
    assert layout.memory.weights == 4 * N_SMALL  # fp32 on CPU
    small_micro = cpu_layout(small_arch(), N_SMALL, batch_seqs=16, procs=2, max_micro_batch=3)
    assert (small_micro.micro_batch_seqs, small_micro.grad_accum) == (2, 4)
    with pytest.raises(LayoutError, match="procs=3"):
        cpu_layout(small_arch(), N_SMALL, batch_seqs=16, procs=3)


def test_gpu_hours_and_wall_time():
    # 1e21 / (989e12 x 0.4) = 2.5278e6 s = 702.2 GPU-hours; on 8 GPUs 87.77 h
    assert gpu_hours(1e21, 989e12, 0.4) == pytest.approx(702.16, abs=0.01)
    assert wall_time_hours(1e21, 8, 989e12, 0.4) == pytest.approx(87.77, abs=0.01)
    with pytest.raises(ValueError, match="mfu"):
        gpu_hours(1e21, 989e12, 0.0)
    with pytest.raises(ValueError, match="gpus"):
        wall_time_hours(1e21, 0, 989e12, 0.4)


def test_cpu_layout_over_nodes_with_tensor_and_pipeline_parallel():
    # 4 processes on 2 nodes, TP 2: DP 2, each rank 16 / 2 = 8 sequences
    layout = cpu_layout(small_arch(), N_SMALL, batch_seqs=16, procs=4, nodes=2, tp=2)
    assert (layout.tp, layout.pp, layout.dp, layout.nodes, layout.procs_per_node) == (
        2,
        1,
        2,
        2,
        2,
    )
    assert layout.micro_batch_seqs * layout.grad_accum * layout.dp == 16
    piped = cpu_layout(small_arch(), N_SMALL, batch_seqs=16, procs=4, nodes=2, pp=2)
    assert (piped.tp, piped.pp, piped.dp) == (1, 2, 2)
    with pytest.raises(LayoutError, match="nodes_per_run=2"):
        cpu_layout(small_arch(), N_SMALL, batch_seqs=16, procs=3, nodes=2)
    with pytest.raises(LayoutError, match="tp x pp = 4"):
        cpu_layout(small_arch(), N_SMALL, batch_seqs=16, procs=2, tp=2, pp=2)
