rule train:
    """One run: Megatron-Core under torchrun. Checkpoints live outside the declared outputs."""
    input:
        unpack(train_inputs),
    output:
        curve=f"{ROOT}/runs/{{run}}/curve.parquet",
        valid=f"{ROOT}/runs/{{run}}/valid.parquet",
        meta=f"{ROOT}/runs/{{run}}/meta.json",
    log:
        f"{ROOT}/logs/train/{{run}}.log",
    benchmark:
        f"{ROOT}/benchmarks/train/{{run}}.tsv"
    priority: train_priority
    conda:
        "../../envs/collapse.yaml"
    threads: lambda wc: spec_of(wc).resources.threads
    resources:
        mem_mb=lambda wc: spec_of(wc).resources.mem_mb,
        runtime=lambda wc: spec_of(wc).resources.runtime_min,
        nodes=train_resource("nodes"),
        gpu=train_resource("gpu"),
        tasks=train_resource("tasks"),
        tasks_per_gpu=train_resource("tasks_per_gpu"),
        mpi=train_resource("mpi"),
        gres=train_resource("gres"),
        cpus_per_task=train_resource("cpus_per_task"),
        slurm_partition=train_resource("slurm_partition"),
        slurm_account=train_resource("slurm_account"),
        slurm_extra=train_resource("slurm_extra"),
    params:
        spec_sha=spec_sha,
        command=lambda wc: train_command(
            spec_of(wc),
            str(LAYOUT.spec(wc.run)),
            executor=CFG.cluster.executor,
            segment=last_segment(wc),
        ),
    shell:
        "{params.command} > {log} 2>&1"


if SEGMENTS:

    rule train_segment:
        """A segment of a run longer than the cluster's time limit (collapse.segments): resume
        from the last checkpoint, train to the segment's last step, save, and leave the marker
        the next segment (the run's train job, for the last) waits for."""
        input:
            unpack(train_inputs),
        output:
            f"{ROOT}/runs/{{run}}/segments/{{segment}}.json",
        log:
            f"{ROOT}/logs/train/{{run}}.segment{{segment}}.log",
        benchmark:
            f"{ROOT}/benchmarks/train/{{run}}.segment{{segment}}.tsv"
        wildcard_constraints:
            run="|".join(re.escape(r) for r in SEGMENTS),
            segment=r"[1-9][0-9]*",
        priority: train_priority
        conda:
            "../../envs/collapse.yaml"
        threads: lambda wc: spec_of(wc).resources.threads
        resources:
            mem_mb=lambda wc: spec_of(wc).resources.mem_mb,
            runtime=lambda wc: spec_of(wc).resources.runtime_min,
            nodes=train_resource("nodes"),
            gpu=train_resource("gpu"),
            tasks=train_resource("tasks"),
            tasks_per_gpu=train_resource("tasks_per_gpu"),
            mpi=train_resource("mpi"),
            gres=train_resource("gres"),
            cpus_per_task=train_resource("cpus_per_task"),
            slurm_partition=train_resource("slurm_partition"),
            slurm_account=train_resource("slurm_account"),
            slurm_extra=train_resource("slurm_extra"),
        params:
            spec_sha=spec_sha,
            command=lambda wc: train_command(
                spec_of(wc),
                str(LAYOUT.spec(wc.run)),
                executor=CFG.cluster.executor,
                segment=int(wc.segment),
            ),
        shell:
            "{params.command} > {log} 2>&1"


if SHARED_RUNS:

    ruleorder: share_run > train

    rule share_run:
        """A sweep run that trains exactly like a family run: that run's outputs, relabelled."""
        input:
            curve=lambda wc: curve(SHARED_RUNS[wc.run]),
            valid=lambda wc: str(LAYOUT.run_dir(SHARED_RUNS[wc.run]) / "valid.parquet"),
            meta=lambda wc: str(LAYOUT.run_dir(SHARED_RUNS[wc.run]) / "meta.json"),
        output:
            curve=f"{ROOT}/runs/{{run}}/curve.parquet",
            valid=f"{ROOT}/runs/{{run}}/valid.parquet",
            meta=f"{ROOT}/runs/{{run}}/meta.json",
        log:
            f"{ROOT}/logs/train/{{run}}.log",
        wildcard_constraints:
            run="|".join(re.escape(r) for r in SHARED_RUNS),
        localrule: True
        conda:
            "../../envs/collapse.yaml"
        params:
            source=lambda wc, input: os.path.dirname(input.curve),
            out=lambda wc, output: os.path.dirname(output.curve),
        shell:
            "collapse stage share --run {wildcards.run} --source {params.source}"
            " --out {params.out} > {log} 2>&1"
