from collapse.sweep_drift import drift_fit_runs


rule sweep:
    """Partial runs of a sweep -> predicted final losses -> the selected setting (+ metrics).

    The family runs at the sweep's TPP band and tau (other sizes than the variants') give the
    size drift that the "drift" method applies to every variant (collapse.sweep_drift).
    """
    input:
        curves=lambda wc: [
            curve(r) for r in PLAN.table[PLAN.table.sweep == wc.sweep].run
        ],
        drift=lambda wc: [curve(r) for r in drift_fit_runs(PLAN.table, wc.sweep)],
        runs=f"{PLAN_OUT}/runs.csv",
    output:
        predictions=f"{ROOT}/sweeps/{{sweep}}/predictions.csv",
        metrics=f"{ROOT}/sweeps/{{sweep}}/metrics.csv",
        drift=f"{ROOT}/sweeps/{{sweep}}/drift.json",
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
        " --fractions {params.fractions} --out {params.out} {input.curves} {input.drift}"
        " > {log} 2>&1"
