rule sweep:
    """Partial runs of a sweep -> predicted final losses -> the selected setting (+ metrics)."""
    input:
        curves=lambda wc: [
            curve(r) for r in PLAN.table[PLAN.table.sweep == wc.sweep].run
        ],
        runs=f"{PLAN_OUT}/runs.csv",
    output:
        predictions=f"{ROOT}/sweeps/{{sweep}}/predictions.csv",
        metrics=f"{ROOT}/sweeps/{{sweep}}/metrics.csv",
    log:
        f"{ROOT}/logs/sweeps/{{sweep}}.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        out=lambda wc, output: os.path.dirname(output.predictions),
        fractions=lambda wc: " ".join(
            f"{f:g}"
            for f in next(s for s in FAMILY.sweeps if s.name == wc.sweep).fractions
        ),
    shell:
        "collapse stage sweep --runs {input.runs}"
        " --fractions {params.fractions} --out {params.out} {input.curves} > {log} 2>&1"
