rule spec:
    """One run's spec, a job of its own: it reruns only when that run's spec changes (its
    params), and the run's training follows in the same call."""
    output:
        f"{PLAN_OUT}/runs/{{run}}.json",
    log:
        f"{ROOT}/logs/plan/{{run}}.log",
    localrule: True
    params:
        spec_sha=spec_sha,
    run:
        write_spec(wildcards.run, output[0], log[0])


rule plan:
    """The compute plan: runs.csv, report.md, plan.png, data.json (and, as inputs, every spec)."""
    input:
        specs=[str(LAYOUT.spec(r)) for r in PLAN.run_names()],
    output:
        runs=f"{PLAN_OUT}/runs.csv",
        report=f"{PLAN_OUT}/report.md",
        data=f"{PLAN_OUT}/data.json",
    log:
        f"{ROOT}/logs/plan.log",
    localrule: True
    conda:
        "../../envs/collapse.yaml"
    params:
        overrides=shlex.join(OVERRIDES),
        out=lambda wc, output: os.path.dirname(output.runs),
        plan_sha=PLAN_SHA,
    shell:
        "collapse plan --no-specs {params.overrides} --out {params.out} > {log} 2>&1"
