rule reference:
    """Normalized curves of the reference sizes -> reference curve (+ Eq. 4 surrogate) per band."""
    input:
        curves=lambda wc: scope_curves(wc, reference_only=True),
        runs=f"{PLAN_OUT}/runs.csv",
    output:
        reference=f"{ROOT}/{{scope}}reference/tpp{{band}}/reference.csv",
        summary=f"{ROOT}/{{scope}}reference/tpp{{band}}/reference.json",
    log:
        f"{ROOT}/logs/{{scope}}reference/tpp{{band}}.log",
    wildcard_constraints:
        scope=SCOPES,
    priority: REFERENCE_PRIORITY  # every monitored run waits for it
    conda:
        "../../envs/collapse.yaml"
    params:
        out=lambda wc, output: os.path.dirname(output[0]),
        sizes=",".join(FAMILY.reference.sizes),
    shell:
        "collapse stage reference --runs {input.runs} --sizes {params.sizes} --band {wildcards.band}"
        " --out {params.out} {input.curves} > {log} 2>&1"


rule monitor_reference:
    """A monitored run's copy of its band's reference, made just before it trains: the monitor
    reads it, and a finished run never waits on the family's reference again."""
    input:
        unpack(monitor_reference_inputs),
    output:
        reference=str(LAYOUT.monitor_reference("{run}")),
        summary=str(LAYOUT.monitor_reference("{run}").with_name("reference.json")),
    log:
        f"{ROOT}/logs/reference/{{run}}.log",
    localrule: True
    conda:
        "../../envs/collapse.yaml"
    shell:
        "cp {input.reference} {output.reference} && cp {input.summary} {output.summary}"
        " > {log} 2>&1"
