rule contrast_reference:
    """The contrast's reference: its runs of the reference sizes (lambda fixed, tau drifts)."""
    input:
        curves=lambda wc: [curve(r) for r in contrast_runs(reference_only=True)],
        runs=f"{PLAN_OUT}/runs.csv",
    output:
        reference=f"{CONTRAST_ROOT}/reference/tpp{{band}}/reference.csv",
        summary=f"{CONTRAST_ROOT}/reference/tpp{{band}}/reference.json",
    log:
        f"{ROOT}/logs/contrast/reference-tpp{{band}}.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        out=lambda wc, output: os.path.dirname(output[0]),
        sizes=",".join(FAMILY.reference.sizes),
    shell:
        "collapse stage reference --runs {input.runs} --sizes {params.sizes} --band {wildcards.band}"
        " --out {params.out} {input.curves} > {log} 2>&1"


rule contrast_collapse:
    """Delta against sigma of the contrast, measured exactly as the family's."""
    input:
        curves=lambda wc: [curve(r) for r in contrast_runs()],
        runs=f"{PLAN_OUT}/runs.csv",
        reference=f"{CONTRAST_ROOT}/reference/tpp{{band}}/reference.csv",
    output:
        stats=f"{CONTRAST_ROOT}/collapse/tpp{{band}}/collapse.json",
    log:
        f"{ROOT}/logs/contrast/collapse-tpp{{band}}.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        out=lambda wc, output: os.path.dirname(output[0]),
        sizes=",".join(FAMILY.reference.sizes),
    shell:
        "collapse stage collapse --runs {input.runs} --sizes {params.sizes} --band {wildcards.band}"
        " --out {params.out} {input.curves} > {log} 2>&1"


rule contrast_gate:
    """One contrast run against the contrast's reference, with the family's gate policy."""
    input:
        curve=f"{ROOT}/runs/{{run}}/curve.parquet",
        reference=f"{CONTRAST_ROOT}/reference/tpp{CONTRAST_BAND}/reference.csv",
        runs=f"{PLAN_OUT}/runs.csv",
    output:
        verdict=f"{CONTRAST_ROOT}/gates/{{run}}.json",
        plot=f"{CONTRAST_ROOT}/gates/{{run}}.png",
    log:
        f"{ROOT}/logs/contrast/gates/{{run}}.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        policy=FAMILY.gates.model_dump_json(),
    shell:
        "collapse stage gate --curve {input.curve} --reference {input.reference}"
        " --runs {input.runs} --policy '{params.policy}'"
        " --out {output.verdict} --plot {output.plot} > {log} 2>&1"
