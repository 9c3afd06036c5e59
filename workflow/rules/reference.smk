rule reference:
    """Normalized curves of the reference sizes -> reference curve (+ Eq. 4 surrogate) per band."""
    input:
        curves=lambda wc: [curve(r) for r in runs_in_band(wc.band, reference_only=True)],
        runs=f"{PLAN_OUT}/runs.csv",
    output:
        reference=f"{ROOT}/reference/tpp{{band}}/reference.csv",
        summary=f"{ROOT}/reference/tpp{{band}}/reference.json",
    log:
        f"{ROOT}/logs/reference/tpp{{band}}.log",
    priority: REFERENCE_PRIORITY  # every monitored run waits for it
    conda:
        "../../envs/collapse.yaml"
    params:
        out=lambda wc, output: os.path.dirname(output[0]),
        sizes=",".join(FAMILY.reference.sizes),
    shell:
        "collapse stage reference --runs {input.runs} --sizes {params.sizes} --band {wildcards.band}"
        " --out {params.out} {input.curves} > {log} 2>&1"
