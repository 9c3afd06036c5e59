# The data stage, by the family's kind of data source (family.data.kind): the package corpus
# (one job), a Megatron blend checked in place (one job), or raw shards tokenized in parallel
# (a tokenizer job, one job per shard, a merge job). Library code: collapse.data, collapse.shards.
DATA_DIR = str(LAYOUT.data_dir)
DATA_KIND = FAMILY.data.kind


if DATA_KIND == "shards":

    rule data_tokenizer:
        """The user's tokenizer.json, checked against the model, or a BPE trained on a sample."""
        input:
            config=ancient(f"{PLAN_OUT}/data.json"),
        output:
            str(LAYOUT.tokenizer),
        log:
            f"{ROOT}/logs/data_tokenizer.log",
        conda:
            "../../envs/collapse.yaml"
        threads: DATA_REQUESTS["data_tokenizer"].threads
        resources:
            mem_mb=data_resource("data_tokenizer", "mem_mb"),
            runtime=data_resource("data_tokenizer", "runtime"),
            cpus_per_task=data_resource("data_tokenizer", "cpus_per_task"),
            slurm_partition=data_resource("data_tokenizer", "slurm_partition"),
            slurm_account=data_resource("data_tokenizer", "slurm_account"),
        params:
            out=lambda wc, output: os.path.dirname(output[0]),
            data_sha=FAMILY.data.fingerprint(),
        shell:
            "collapse data --config {input.config} --out {params.out} --step tokenizer"
            " > {log} 2>&1"

    rule data_shard:
        """One shard of the raw files -> its train/valid .bin/.idx (memory: one shard)."""
        input:
            config=ancient(f"{PLAN_OUT}/data.json"),
            tokenizer=str(LAYOUT.tokenizer),
        output:
            multiext(
                f"{DATA_DIR}/shards/{{shard}}",
                ".train.bin",
                ".train.idx",
                ".valid.bin",
                ".valid.idx",
                ".train.docs",
                ".valid.docs",
                ".json",
            ),
        log:
            f"{ROOT}/logs/data_shard/{{shard}}.log",
        wildcard_constraints:
            shard=r"\d{5}",
        conda:
            "../../envs/collapse.yaml"
        threads: DATA_REQUESTS["data_shard"].threads
        resources:
            mem_mb=data_resource("data_shard", "mem_mb"),
            runtime=data_resource("data_shard", "runtime"),
            cpus_per_task=data_resource("data_shard", "cpus_per_task"),
            slurm_partition=data_resource("data_shard", "slurm_partition"),
            slurm_account=data_resource("data_shard", "slurm_account"),
        params:
            out=lambda wc, output: os.path.dirname(os.path.dirname(output[0])),
            data_sha=FAMILY.data.fingerprint(),
        shell:
            "collapse data --config {input.config} --out {params.out} --step shard"
            " --shard {wildcards.shard} > {log} 2>&1"

    rule data:
        """Every shard -> one Megatron indexed dataset per split, and meta.json."""
        input:
            config=ancient(f"{PLAN_OUT}/data.json"),
            tokenizer=str(LAYOUT.tokenizer),
            shards=lambda wc: shard_markers(FAMILY.data, DATA_DIR),
        output:
            DATA_FILES["outputs"],
        log:
            f"{ROOT}/logs/data.log",
        conda:
            "../../envs/collapse.yaml"
        threads: DATA_REQUESTS["data"].threads
        resources:
            mem_mb=data_resource("data", "mem_mb"),
            runtime=data_resource("data", "runtime"),
            cpus_per_task=data_resource("data", "cpus_per_task"),
            slurm_partition=data_resource("data", "slurm_partition"),
            slurm_account=data_resource("data", "slurm_account"),
        params:
            out=lambda wc, output: os.path.dirname(output[-1]),
            data_sha=FAMILY.data.fingerprint(),
        shell:
            "collapse data --config {input.config} --out {params.out} --step merge > {log} 2>&1"

else:

    rule data:
        """The package corpus -> BPE tokenizer -> Megatron indexed datasets; or a user's
        Megatron blend, checked in place (meta.json names it for training)."""
        input:
            config=ancient(f"{PLAN_OUT}/data.json"),
        output:
            DATA_FILES["outputs"],
        log:
            f"{ROOT}/logs/data.log",
        conda:
            "../../envs/collapse.yaml"
        threads: DATA_REQUESTS["data"].threads
        resources:
            mem_mb=data_resource("data", "mem_mb"),
            runtime=data_resource("data", "runtime"),
            cpus_per_task=data_resource("data", "cpus_per_task"),
            slurm_partition=data_resource("data", "slurm_partition"),
            slurm_account=data_resource("data", "slurm_account"),
        params:
            out=lambda wc, output: os.path.dirname(output[-1]),
            data_sha=FAMILY.data.fingerprint(),
        shell:
            "collapse data --config {input.config} --out {params.out} > {log} 2>&1"
