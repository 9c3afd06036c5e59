rule gate:
    """Residual of one run against its band's reference: a pass/fail verdict and its evidence."""
    input:
        curve=f"{ROOT}/runs/{{run}}/curve.parquet",
        reference=lambda wc: str(reference_csv(LAYOUT, spec_of(wc).tpp_band)),
        runs=f"{PLAN_OUT}/runs.csv",
    output:
        verdict=f"{ROOT}/gates/{{run}}.json",
        plot=f"{ROOT}/gates/{{run}}.png",
    log:
        f"{ROOT}/logs/gates/{{run}}.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        allow_fail=lambda wc: (
            "--allow-fail" if wc.run in FAMILY.gates.allow_fail else ""
        ),
        policy=FAMILY.gates.model_dump_json(),
    shell:
        "collapse stage gate --curve {input.curve} --reference {input.reference}"
        " --runs {input.runs} --policy '{params.policy}' {params.allow_fail}"
        " --out {output.verdict} --plot {output.plot} > {log} 2>&1"


rule collapse_stats:
    """Delta across sizes and seeds against the seed noise floor sigma; supercollapse verdict."""
    input:
        curves=lambda wc: [curve(r) for r in runs_in_band(wc.band)],
        runs=f"{PLAN_OUT}/runs.csv",
        reference=f"{ROOT}/reference/tpp{{band}}/reference.csv",
    output:
        stats=f"{ROOT}/collapse/tpp{{band}}/collapse.json",
    log:
        f"{ROOT}/logs/collapse/tpp{{band}}.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        out=lambda wc, output: os.path.dirname(output[0]),
        sizes=",".join(FAMILY.reference.sizes),
    shell:
        "collapse stage collapse --runs {input.runs} --sizes {params.sizes} --band {wildcards.band}"
        " --out {params.out} {input.curves} > {log} 2>&1"
