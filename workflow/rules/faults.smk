rule detect:
    """Fault-detection experiment: when the collapse monitor and raw-loss detectors fire."""
    input:
        specs=[ancient(str(LAYOUT.spec(r))) for r in detect_runs()],
        curves=[curve(r) for r in detect_runs()],
        references=sorted({spec_reference(r) for r in detect_runs()}),
        runs=f"{PLAN_OUT}/runs.csv",
    output:
        detections=f"{ROOT}/faults/detections.csv",
        table=f"{ROOT}/faults/detections.md",
        figure=f"{ROOT}/faults/detections.png",
    log:
        f"{ROOT}/logs/faults/detect.log",
    conda:
        "../../envs/collapse.yaml"
    params:
        out=lambda wc, output: os.path.dirname(output.detections),
        policy=FAMILY.gates.model_dump_json(),
        detectors=(FAMILY.faults.detectors.model_dump_json() if FAULTS_ON else "{}"),
    shell:
        "collapse stage detect --policy '{params.policy}' --detectors '{params.detectors}'"
        " --runs {input.runs} --out {params.out} {input.specs} > {log} 2>&1"
