rule evaluate:
    """Held-out loss and downstream tasks (lm-evaluation-harness) of a finished, gated run."""
    input:
        meta=f"{ROOT}/runs/{{run}}/meta.json",
        gate=f"{ROOT}/gates/{{run}}.json",
        spec=ancient(str(LAYOUT.spec("{run}"))),
    output:
        result=f"{ROOT}/evals/{{run}}.json",
    log:
        f"{ROOT}/logs/evals/{{run}}.log",
    conda:
        "../../envs/collapse.yaml"
    # CPU: one thread, as training (a second job uses the other core); a GPU cluster: one GPU
    # and its share of CPUs (collapse.jobs.eval_request)
    threads: lambda wc: eval_job(wc).threads
    resources:
        mem_mb=eval_resource("mem_mb"),
        runtime=eval_resource("runtime"),
        gpu=eval_resource("gpu"),
        cpus_per_task=eval_resource("cpus_per_task"),
        slurm_partition=eval_resource("slurm_partition"),
        slurm_account=eval_resource("slurm_account"),
    params:
        limit=f"--limit {FAMILY.evaluation.limit}" if FAMILY.evaluation.limit else "",
        tasks=",".join(FAMILY.evaluation.tasks),
        batch=lambda wc: eval_job(wc).batch_size,
    shell:
        "collapse stage evaluate --spec {input.spec} --gate {input.gate} {params.limit}"
        " --tasks {params.tasks} --batch-size {params.batch} --out {output.result} > {log} 2>&1"
