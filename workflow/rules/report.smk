from collapse.artifacts import reported

REPORT = f"{ROOT}/report"
# The figures and tables --report shows (collapse.artifacts, the one list the report stage
# writes from); their captions are written by the report stage itself, from the same list.
REPORTED = reported(sweeps=bool(SWEEPS), faults=FAULTS_ON, contrast=CONTRAST_ON)


rule report:
    """Every figure and table of the family from results/: one target (also `--report`)."""
    input:
        runs=f"{PLAN_OUT}/runs.csv",
        stats=expand(f"{ROOT}/collapse/tpp{{band}}/collapse.json", band=TPP_BANDS),
        gates=expand(f"{ROOT}/gates/{{run}}.json", run=FAMILY_RUNS),
        evals=expand(f"{ROOT}/evals/{{run}}.json", run=FAMILY_RUNS),
        sweeps=expand(f"{ROOT}/sweeps/{{sweep}}/metrics.csv", sweep=SWEEPS),
        faults=rules.detect.output.detections if FAULTS_ON else [],
        contrast=(
            [f"{CONTRAST_ROOT}/collapse/tpp{CONTRAST_BAND}/collapse.json"]
            + expand(f"{CONTRAST_ROOT}/gates/{{run}}.json", run=CONTRAST_RUNS)
            if CONTRAST_ON
            else []
        ),
    output:
        index=f"{REPORT}/index.md",
        reported=[
            report(
                f"{REPORT}/{a.file}",
                caption=os.path.abspath(f"{REPORT}/captions/{a.name}.rst"),
                category=a.category,
            )
            for a in REPORTED
        ],
        captions=[f"{REPORT}/captions/{a.name}.rst" for a in REPORTED],
    log:
        f"{ROOT}/logs/report.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        root=lambda wc, input: os.path.dirname(os.path.dirname(input.runs)),
    shell:
        "collapse stage report --root {params.root} --out {output.index} > {log} 2>&1"
