REPORT = f"{ROOT}/report"
FIGURES = ["collapse_curves", "delta_sigma", "gate_summary", "downstream_vs_flops"]
if SWEEPS:
    FIGURES += ["sweep_predictions", "sweep_metrics"]
if FAULTS_ON:
    FIGURES += ["fault_detection"]
if CONTRAST_ON:
    FIGURES += ["contrast"]


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
        figures=[
            report(
                f"{REPORT}/{name}.png",
                caption=f"../report/{name}.rst",
                category="collapse",
            )
            for name in FIGURES
        ],
        table=report(
            f"{REPORT}/family_table.csv",
            caption="../report/family_table.rst",
            category="tables",
        ),
    log:
        f"{ROOT}/logs/report.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        root=lambda wc, input: os.path.dirname(os.path.dirname(input.runs)),
    shell:
        "collapse stage report --root {params.root} --out {output.index} > {log} 2>&1"
