"""Evaluation and data jobs ask the cluster for what the plan says they need (collapse.jobs),
checked by hand arithmetic on slurm_h100 and in the dry run."""

from __future__ import annotations

import math
import re

import pytest
from workflow_cli import run_snakemake

from collapse import jobs
from collapse.config import load_config
from collapse.plan import plan_family

MIB, GIB = 2**20, 2**30


@pytest.fixture(scope="module")
def celerity():
    cfg = load_config(["family=celerity", "cluster=slurm_h100"])
    plan = plan_family(cfg, corpus_tokens=10**12)
    specs = {}
    for spec in plan.runs:
        specs.setdefault(spec.size, spec)
    return cfg, specs


def _eval(cfg, spec):
    ev = cfg.family.evaluation
    return jobs.eval_request(
        cfg.cluster, spec.model, spec.params, tasks=ev.tasks, limit=ev.limit, size=spec.size
    )


def test_celerity_evaluates_on_one_gpu_with_a_batch_that_fits_it(celerity):
    cfg, specs = celerity
    big = specs["3.9B"]
    assert big.params == 3_882_176_512
    request = _eval(cfg, big)
    # 68 GiB usable (85 % of 80); fixed: bf16 weights 2 x 3,882,176,512 = 7,764,353,024 and the
    # shared ALiBi bias 16 x 8192^2 x 2 = 2,147,483,648; per window: logits (2 + 4 + 4) x 8192 x
    # 128,256 = 10,506,731,520 and one layer 2 x 8192 x (2 x 2048 + 4 x 2048 + 2 x 16384) =
    # 738,197,504; (73,014,444,032 - 9,911,836,672) / 11,244,929,024 = 5.6 -> 5 windows
    assert request.batch_size == 5 and request.gpus == 1
    assert jobs.eval_memory_bytes(big.model, big.params, 0) == 7_764_353_024 + 2_147_483_648
    per_window = jobs.eval_memory_bytes(big.model, big.params, 1) - jobs.eval_memory_bytes(
        big.model, big.params, 0
    )
    assert per_window == 10_506_731_520 + 738_197_504
    assert request.threads == 8  # cpus_per_gpu
    # host: 4096 MB + 8 bytes a parameter = 4096 + ceil(31,057,412,096 / 2^20) = 33,715 MB
    assert request.mem_mb == 4096 + math.ceil(8 * 3_882_176_512 / MIB) == 33_715
    # forward FLOPs 2 N x 65,881,344 scored tokens at 40 % of 989 TFLOP/s = 21.6 min; plus 5 min
    # start-up, x 1.5 margin: 39.9 -> 40 min
    assert jobs.eval_scored_tokens(big.model, cfg.family.evaluation.tasks, None) == 65_881_344
    assert (
        request.runtime_min
        == math.ceil(1.5 * (2 * 3_882_176_512 * 65_881_344 / (989e12 * 0.4) / 60 + 5))
        == 40
    )
    assert _eval(cfg, specs["1.8B"]).batch_size == 6
    resources = request.resources(cfg.cluster)
    assert resources["gpu"] == 1 and resources["slurm_partition"] == "gpu"
    assert resources["cpus_per_task"] == 8 and resources["mem_mb"] == 33_715


def test_scored_tokens_by_hand(celerity):
    cfg, specs = celerity
    arch = specs["3.9B"].model
    # held-out 128 x 8192; per task examples x choices x min(8192, (shots + 1) x 128)
    by_hand = (
        128 * 8192
        + 299 * 4 * 26 * 128  # arc_challenge, 25 shots
        + 570 * 4 * 128
        + 3270 * 2 * 128
        + 10042 * 4 * 11 * 128  # hellaswag, 10 shots
        + 1838 * 2 * 128
        + 1954 * 3 * 128
        + 1267 * 2 * 6 * 128  # winogrande, 5 shots
    )
    assert jobs.eval_scored_tokens(arch, list(jobs.TASK_EXAMPLES), None) == by_hand
    assert jobs.eval_scored_tokens(arch, ["piqa"], 40) == 128 * 8192 + 40 * 2 * 128


def test_a_model_that_does_not_fit_one_gpu_fails_naming_the_size(celerity):
    cfg, specs = celerity
    small_gpu = cfg.cluster.model_copy(update={"gpu_mem_gb": 16})
    ev = cfg.family.evaluation
    with pytest.raises(jobs.ResourceError, match=r"evaluation of size 3.9B.*one GPU"):
        jobs.eval_request(
            small_gpu, specs["3.9B"].model, specs["3.9B"].params, tasks=ev.tasks, limit=None,
            size="3.9B",
        )  # fmt: skip


def test_requests_stay_within_the_partition():
    limits = jobs.Limits(cpus=64, mem_mb=983_040, runtime_min=30)
    request = jobs.JobRequest(threads=8, mem_mb=33_715, runtime_min=40, gpus=1)
    assert jobs.capped(request, limits, "job").runtime_min == 30  # held to the time limit
    with pytest.raises(jobs.ResourceError, match="job: needs 1000.0 GB.*960.0 GB"):
        jobs.capped(jobs.JobRequest(1, 1_024_000, 10), limits, "job")
    with pytest.raises(jobs.ResourceError, match="65 CPUs"):
        jobs.capped(jobs.JobRequest(65, 1000, 10), limits, "job")
    cfg = load_config(["family=celerity", "cluster=slurm_h100"])
    # one node of slurm_h100: 8 GPUs x 8 CPUs, 8 x 120 GB, and the partition's 48 h
    assert jobs.partition_limits(cfg.cluster) == jobs.Limits(64, 8 * 120 * 1024, 2880)


def test_the_corpus_data_job_is_sized_from_the_corpus_bytes():
    cfg = load_config(["family=tiny", "cluster=local"])
    corpus = jobs.corpus_bytes(cfg.family.data)
    # the seven package sources' file sizes
    assert (
        corpus == 4_956_054 + 4_873_621 + 4_163_486 + 4_140_862 + 4_068_610 + 4_184_932 + 4_164_692
    )
    request = jobs.data_requests(cfg.cluster, cfg.family.data)["data"]
    expected = jobs.CORPUS_BASE_MB + math.ceil(jobs.CORPUS_MEMORY_FACTOR * corpus / MIB)
    assert request.mem_mb == expected
    assert request.mem_mb <= cfg.cluster.mem_gb * 1024
    # Celerity's blend is checked in place: the base request (its prefixes are placeholders)
    celerity = load_config(["family=celerity", "cluster=slurm_h100"])
    check = jobs.data_requests(celerity.cluster, celerity.family.data)["data"]
    assert (check.mem_mb, check.threads) == (jobs.CHECK_BASE_MB, 1)


def test_the_dry_run_shows_every_request(tmp_path):
    out = run_snakemake(
        tmp_path, "-n", "-p", "--config", "family=celerity", "cluster=slurm_h100", timeout=180
    )
    text = out.stdout
    blocks = text.split("\n\n")

    def block(rule, run):
        for b in blocks:
            if f"rule {rule}:" in b and (run is None or f"run={run}" in b):
                return b
        raise AssertionError(f"no {rule} job for {run} in the dry run")

    ev = block("evaluate", "3.9B-tpp20-s0")
    assert re.search(r"mem_mb=33715\b", ev) and "gpu=1" in ev and "cpus_per_task=8" in ev
    assert "runtime=40" in ev and "slurm_partition=gpu" in ev
    assert "--batch-size 5 " in ev
    data = block("data", None)
    assert f"mem_mb={jobs.CHECK_BASE_MB}" in data and "slurm_partition=gpu" in data
