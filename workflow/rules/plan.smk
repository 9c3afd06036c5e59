rule spec:
    """One run's spec, written from the plan made once at parse time. Its params are its rerun
    trigger, on a job with no inputs: Snakemake 9.27 skips the params check of a job below one
    that reruns (e.g. training below a rebuilt reference), so a trigger on the training rule
    alone would retrain a changed run only in the next call. A shell job, not a `run:` block,
    which would start Snakemake anew for every spec."""
    output:
        f"{PLAN_OUT}/runs/{{run}}.json",
    log:
        f"{ROOT}/logs/plan/{{run}}.log",
    localrule: True
    conda:
        "../../envs/collapse.yaml"
    params:
        spec=spec_json,
    shell:
        "printf '%s' {params.spec:q} > {output} 2> {log}"


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
