rule gate:
    """Residual of one run against its scope's reference: a pass/fail verdict and its evidence."""
    input:
        curve=f"{ROOT}/runs/{{run}}/curve.parquet",
        reference=scope_reference,
        runs=f"{PLAN_OUT}/runs.csv",
    output:
        verdict=f"{ROOT}/{{scope}}gates/{{run}}.json",
        plot=f"{ROOT}/{{scope}}gates/{{run}}.png",
    log:
        f"{ROOT}/logs/{{scope}}gates/{{run}}.log",
    wildcard_constraints:
        scope=SCOPES,
    conda:
        "../../envs/collapse.yaml"
    params:
        # a family run the policy lets fail; its contrast gate is measured as any other
        allow_fail=lambda wc: (
            "--allow-fail"
            if not wc.scope and wc.run in FAMILY.gates.allow_fail
            else ""
        ),
        policy=FAMILY.gates.model_dump_json(),
    shell:
        "collapse stage gate --curve {input.curve} --reference {input.reference}"
        " --runs {input.runs} --policy '{params.policy}' {params.allow_fail}"
        " --out {output.verdict} --plot {output.plot} > {log} 2>&1"


rule collapse_stats:
    """Delta across sizes and seeds against the seed noise floor sigma; supercollapse verdict."""
    input:
        curves=scope_curves,
        runs=f"{PLAN_OUT}/runs.csv",
        reference=f"{ROOT}/{{scope}}reference/tpp{{band}}/reference.csv",
    output:
        stats=f"{ROOT}/{{scope}}collapse/tpp{{band}}/collapse.json",
    log:
        f"{ROOT}/logs/{{scope}}collapse/tpp{{band}}.log",
    wildcard_constraints:
        scope=SCOPES,
    conda:
        "../../envs/collapse.yaml"
    params:
        out=lambda wc, output: os.path.dirname(output[0]),
        sizes=",".join(FAMILY.reference.sizes),
    shell:
        "collapse stage collapse --runs {input.runs} --sizes {params.sizes} --band {wildcards.band}"
        " --out {params.out} {input.curves} > {log} 2>&1"
