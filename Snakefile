"""Train a family of LLMs whose normalized loss curves collapse (arXiv 2509.25087).

snakemake -n                            # the family's whole DAG, nothing run
snakemake --cores all plan              # the compute plan only: results/<family>/plan/
snakemake --cores all                   # the default tiny family, end to end, on this CPU
snakemake --cores all --config faults=standard   # + the fault-detection experiment
snakemake --profile slurm --config family=ladder cluster=slurm_h100
"""


include: "workflow/rules/common.smk"
include: "workflow/rules/plan.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/reference.smk"
include: "workflow/rules/gates.smk"
include: "workflow/rules/sweep.smk"
include: "workflow/rules/faults.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


rule all:
    default_target: True
    input:
        rules.report.output,


# last: caps the runtime of every rule above at the cluster's time limit
include: "workflow/rules/limits.smk"
