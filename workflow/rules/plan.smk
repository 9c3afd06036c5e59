rule plan:
    """The compute plan: one spec per run, runs.csv, report.md, plan.png, data.json."""
    output:
        runs=f"{PLAN_OUT}/runs.csv",
        report=f"{PLAN_OUT}/report.md",
        data=f"{PLAN_OUT}/data.json",
        specs=[str(LAYOUT.spec(r)) for r in PLAN.run_names()],
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
        "collapse plan {params.overrides} --out {params.out} > {log} 2>&1"
