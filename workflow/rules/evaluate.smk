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
    threads: 1  # as training: a second job uses the other core (the largest run trains meanwhile)
    params:
        limit=f"--limit {FAMILY.evaluation.limit}" if FAMILY.evaluation.limit else "",
        tasks=",".join(FAMILY.evaluation.tasks),
    shell:
        "collapse stage evaluate --spec {input.spec} --gate {input.gate} {params.limit}"
        " --tasks {params.tasks} --out {output.result} > {log} 2>&1"
