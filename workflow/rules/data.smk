rule data:
    """Corpus -> deduplicated documents -> BPE tokenizer -> Megatron indexed datasets."""
    input:
        config=ancient(f"{PLAN_OUT}/data.json"),
    output:
        multiext(str(LAYOUT.train_prefix), ".bin", ".idx"),
        multiext(str(LAYOUT.valid_prefix), ".bin", ".idx"),
        tokenizer=str(LAYOUT.tokenizer),
        meta=str(LAYOUT.data_dir / "meta.json"),
    log:
        f"{ROOT}/logs/data.log",
    conda:
        "../../envs/collapse.yaml"
    threads: 2
    resources:
        mem_mb=8000,
        runtime=60,
    params:
        out=lambda wc, output: os.path.dirname(output.meta),
        data_sha=FAMILY.data.fingerprint(),
    shell:
        "collapse data --config {input.config} --out {params.out} > {log} 2>&1"
