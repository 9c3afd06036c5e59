rule report:
    """Every figure and table of the family from results/: one target."""
    input:
        runs=f"{PLAN_OUT}/runs.csv",
        stats=expand(f"{ROOT}/collapse/tpp{{band}}/collapse.json", band=TPP_BANDS),
        gates=expand(f"{ROOT}/gates/{{run}}.json", run=FAMILY_RUNS),
        evals=expand(f"{ROOT}/evals/{{run}}.json", run=FAMILY_RUNS),
        sweeps=expand(f"{ROOT}/sweeps/{{sweep}}/metrics.csv", sweep=SWEEPS),
    output:
        index=f"{ROOT}/report/index.md",
    log:
        f"{ROOT}/logs/report.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        root=lambda wc, input: os.path.dirname(os.path.dirname(input.runs)),
    shell:
        "collapse stage report --root {params.root} --out {output.index} > {log} 2>&1"
