"""The family spec: Hydra composition, validation, and the messages a bad spec gets."""

import copy
from pathlib import Path

import pytest

from collapse.config import (
    ConfigError,
    compose_config,
    config_options,
    hydra_overrides,
    load_config,
    validate_config,
)
from collapse.plan import contrast_members, plan_family, plan_report_markdown

TINY_TPP5 = ["family=experiments/tiny_tpp5"]  # the TPP-5 family that tiny_fixed_wd varies


@pytest.fixture(scope="module")
def tiny_raw():
    """tiny_tpp5 composed: the malformed-spec cases below name its sizes (d48 first)."""
    return compose_config(TINY_TPP5)


def _error(raw) -> str:
    with pytest.raises(ConfigError) as info:
        plan_family(validate_config(raw))
    return str(info.value)


def test_three_families_compose_and_validate():
    for name, cluster in (("tiny", "local"), ("celerity", "slurm_h100"), ("ladder", "slurm_h100")):
        cfg = load_config([f"family={name}", f"cluster={cluster}"])
        assert cfg.family.name == name
        assert cfg.cluster.name == cluster


@pytest.mark.parametrize("family", config_options(Path(__file__).parents[1] / "config", "family"))
def test_every_family_in_the_config_group_plans(family):
    """The experiments' probes and contrasts too: a family YAML that drifts from the schema fails
    here, not when it is next run (planning needs no corpus, so none has to be installed)."""
    plan = plan_family(load_config([f"family={family}"]))
    assert len(plan.table) > 0
    assert plan.table.tokens.gt(0).all()


def test_tiny_is_cpu_sized_and_sees_no_token_twice():
    """The default family: three or more widths over 2x in parameters, no GPU, and a corpus
    (the installable prose, Bibles included: 14.06M training tokens, measured) that no size
    repeats, so the plan has no warning."""
    plan = plan_family(load_config([]), corpus_tokens=14_055_921)
    fam = plan.table[plan.table.role == "family"]
    assert fam["size"].nunique() >= 3
    assert fam.params.max() / fam.params.min() >= 2.4
    assert (fam.gpus == 0).all()
    assert plan.table.epochs.max() < 0.8 and plan.warnings() == []


def test_a_size_that_repeats_the_corpus_is_warned_about(tmp_path, capsys):
    """tiny_tpp5's d192 sees 5.43M tokens of a 5.05M-token corpus (measured): the plan says so,
    with the fix, in its warnings, its report and on stderr; a corpus big enough gives no
    warning, and tiny (TPP 10, the Bibles added) needs none."""
    from collapse.cli import main

    plan = plan_family(load_config(TINY_TPP5), corpus_tokens=5_049_189)
    [warning] = plan.warnings()
    assert "seen more than once by d192 (1.08 epochs of 5.43M tokens)" in warning
    assert "family.data.sources" in warning and "family.tpp" in warning
    assert "## Warnings" in plan_report_markdown(plan)
    assert plan_family(load_config(TINY_TPP5), corpus_tokens=6_000_000).warnings() == []
    assert "## Warnings" not in plan_report_markdown(
        plan_family(load_config(TINY_TPP5), corpus_tokens=6_000_000)
    )
    # before the data exists the estimate (bytes per token at vocab 512) sees it too
    assert main(["plan", "family=experiments/tiny_tpp5", "--out", str(tmp_path / "tpp5")]) == 0
    assert "warning: the corpus is seen more than once by d192" in capsys.readouterr().err
    assert main(["plan", "--out", str(tmp_path / "tiny")]) == 0
    assert "warning" not in capsys.readouterr().err
    # a capped corpus names the cap as the first fix
    [capped] = plan_family(
        load_config(["+family.data.max_corpus_bytes=1000000"]), corpus_tokens=500_000
    ).warnings()
    assert (
        capped.count("epochs of") == 3 and "raise family.data.max_corpus_bytes (1MB now)" in capped
    )


def test_celerity_matches_the_paper_table():
    cfg = load_config(["family=celerity", "cluster=slurm_h100"])
    fam = cfg.family
    assert [(s.d_model, s.n_heads, s.n_layers, s.batch_seqs) for s in fam.sizes] == [
        (640, 10, 13, 176),
        (896, 14, 17, 240),
        (1152, 9, 23, 336),
        (1536, 12, 30, 464),
        (2048, 16, 40, 672),
    ]
    assert fam.tpp == [20, 80, 234] and fam.tau == [0.175, 0.087, 0.05]
    assert fam.arch.vocab_size == 128256 and fam.arch.seq_len == 8192
    assert fam.arch.activation == "squared_relu" and fam.arch.ffn_mult == 8
    assert fam.arch.positions == "alibi" and fam.parameterization.kind == "completep"
    # head size 64, 64, 128, 128, 128
    assert [s.d_model // s.n_heads for s in fam.sizes] == [64, 64, 128, 128, 128]


def test_gates_enforce_reaches_the_gate_policy():
    """The family's gates block reaches the gate stage's policy unchanged (tiny_tpp5: advisory)."""
    import json

    from collapse.gates import GatePolicy

    assert load_config([]).family.gates.enforce is True  # tiny's sizes pass their gates
    tiny = load_config(TINY_TPP5).family.gates
    assert tiny.enforce is False  # this one does not collapse; its verdicts do not block
    policy = GatePolicy.model_validate(json.loads(tiny.model_dump_json()))
    assert policy.enforce is False and policy.k_sigma == tiny.k_sigma
    smoke = load_config(["family=smoke"]).family.gates
    assert GatePolicy.model_validate(json.loads(smoke.model_dump_json())).enforce is True


def test_contrast_family_holds_lambda_not_tau():
    """tiny_fixed_wd is tiny_tpp5 with one weight decay for every size: tau drifts with size."""
    # one corpus size for both (else each estimates it from its own data folder, if built)
    tiny = plan_family(load_config(TINY_TPP5), corpus_tokens=5_000_000).table
    fixed = plan_family(
        load_config(["family=experiments/tiny_fixed_wd"]), corpus_tokens=5_000_000
    ).table
    tiny, fixed = (t[t.role == "family"].set_index("run") for t in (tiny, fixed))
    assert list(fixed.index) == list(tiny.index)
    assert fixed.weight_decay.nunique() == 1 and tiny.tau.round(6).nunique() == 1
    assert fixed.weight_decay.iloc[0] == tiny.weight_decay.iloc[0]  # the smallest size's lambda
    assert fixed.tau.round(3).nunique() > 1
    assert (
        (fixed.drop(columns=["weight_decay", "tau"]) == tiny.drop(columns=["weight_decay", "tau"]))
        .all()
        .all()
    )


def test_the_familys_contrast_is_its_runs_with_the_smallest_sizes_lambda():
    """tiny's contrast (family.contrast) plans the tiny_fixed_wd family's runs inside tiny:
    the same specs but the name, the role and what lambda sets (tau drifts with size). The
    smallest size has that lambda already: the contrast shares its family runs, no twins."""
    plan = plan_family(load_config(TINY_TPP5), corpus_tokens=5_000_000)
    fixed = plan_family(load_config(["family=experiments/tiny_fixed_wd"]), corpus_tokens=5_000_000)
    assert fixed.run_names("contrast") == []  # the contrast family has no contrast of its own
    assert contrast_members(fixed.table).empty
    contrast = plan.run_names("contrast")
    smallest = [r for r in fixed.run_names("family") if r.startswith("d48-")]
    assert contrast == [f"contrast-{r}" for r in fixed.run_names("family") if r not in smallest]
    assert list(contrast_members(plan.table).run) == smallest + contrast
    for run in contrast:
        mine, twin = plan.spec(run), fixed.spec(run.removeprefix("contrast-"))
        assert mine.optim == twin.optim and mine.model == twin.model and mine.mup == twin.mup
        assert mine.role == "contrast" and not mine.monitor.enabled
        assert mine.variant == {"weight_decay": plan.spec("d48-tpp5-s0").optim.weight_decay}
    taus = contrast_members(plan.table).groupby("size", sort=False).tau.first()
    assert list(taus.index) == ["d48", "d64", "d96", "d128", "d192"]
    assert taus.is_monotonic_increasing and taus.iloc[0] == pytest.approx(0.2)
    assert taus.iloc[-1] > 0.24
    assert "6 contrast" in plan_report_markdown(plan)


def test_wrong_tau_fault_takes_the_smallest_sizes_decay_as_the_contrast_does():
    """A wrong-tau fault is the largest size with the smallest size's eta * lambda (default) or
    lambda: the tau it trains at is the contrast's for that size."""
    plan = plan_family(load_config(["faults=standard"]), corpus_tokens=14_000_000)
    fault = plan.spec("fault-wrong-tau-d160-s0")
    assert fault.optim == plan.spec("contrast-d160-tpp10-s0").optim
    assert fault.optim.tau == pytest.approx(0.131, abs=0.002)  # 1.5x off the family's 0.2
    held = plan_family(
        load_config(["faults=standard", "+family.faults.injections.3.holds=weight_decay"]),
        corpus_tokens=14_000_000,
    )
    fault = held.spec("fault-wrong-tau-d160-s0")
    assert fault.optim.weight_decay == held.spec("d96-tpp10-s0").optim.weight_decay
    assert 0.2 < fault.optim.tau < 0.23  # lambda alone barely moves tau under µP


def test_the_contrast_trains_only_the_sizes_it_names():
    """contrast.sizes: tiny trains only d160 again; null trains every size but the smallest."""
    plan = plan_family(load_config([]), corpus_tokens=14_000_000)
    assert plan.run_names("contrast") == ["contrast-d160-tpp10-s0"]
    assert list(contrast_members(plan.table)["size"].unique()) == ["d96", "d160"]
    every = plan_family(load_config(["family.contrast.sizes=null"]), corpus_tokens=14_000_000)
    assert every.run_names("contrast") == ["contrast-d128-tpp10-s0", "contrast-d160-tpp10-s0"]


def test_hydra_overrides_reach_the_spec():
    cfg = load_config(["family.tpp=[5,10]", "family.tau=[0.3]", "family.seeds=[3]"])
    assert cfg.family.tpp == [5, 10] and cfg.family.tau == [0.3] and cfg.family.seeds == [3]


def test_snakemake_config_keys_become_overrides():
    assert hydra_overrides(
        {"family": "ladder", "overrides": "family.tpp=[20] cluster=slurm_h100"}
    ) == [
        "family=ladder",
        "family.tpp=[20]",
        "cluster=slurm_h100",
    ]
    assert hydra_overrides({"overrides": ["a=1", "b=2"]}) == ["a=1", "b=2"]
    with pytest.raises(ConfigError, match="unknown keys.*famly"):
        hydra_overrides({"famly": "tiny"})


def test_unknown_family_suggests_the_closest():
    with pytest.raises(
        ConfigError, match=r"family: no config named 'tinny' \(did you mean 'tiny'\?\)"
    ):
        load_config(["family=tinny"])


def test_override_of_a_field_the_yaml_leaves_out_says_to_prefix_plus():
    with pytest.raises(ConfigError, match=r"family.gates.monitor: .*\+family.gates.monitor=VALUE"):
        load_config(["family.gates.monitor=false"])
    assert load_config(["+family.gates.monitor=false"]).family.gates.monitor is False
    with pytest.raises(ConfigError, match=r"monitr.*did you mean 'monitor'"):
        load_config(["+family.gates.monitr=false"])


# Each malformed spec: (what to break, the words the message must contain).
def _set(path, value):
    def edit(raw):
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return edit


def _delete(path):
    def edit(raw):
        node = raw
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return edit


MALFORMED = {
    "missing sizes": (_delete(["family", "sizes"]), ["family.sizes", "required field is missing"]),
    "missing tpp": (_delete(["family", "tpp"]), ["family.tpp", "missing"]),
    "zero d_model": (
        _set(["family", "sizes", 0, "d_model"], 0),
        ["sizes[0](d48).d_model", "greater than 0"],
    ),
    "negative layers": (
        _set(["family", "sizes", 1, "n_layers"], -2),
        ["sizes[1](d64).n_layers", "greater than 0"],
    ),
    "heads do not divide": (
        _set(["family", "sizes", 0, "n_heads"], 5),
        ["n_heads=5 does not divide d_model=48", "pick n_heads"],
    ),
    "misspelled size key": (
        _set(["family", "sizes", 0, "d_modle"], 64),
        ["sizes[0](d48).d_modle", "unknown key", "did you mean 'd_model'"],
    ),
    "misspelled top key": (
        _set(["family", "seed"], [0]),
        ["family.seed", "unknown key", "did you mean 'seeds'"],
    ),
    "misspelled nested key": (
        _set(["family", "parameterization", "eta_bas"], 0.1),
        ["parameterization.eta_bas", "did you mean 'eta_base'"],
    ),
    "tpp out of range": (
        _set(["family", "tpp"], [0.01]),
        ["family.tpp[0]", "greater than or equal to 0.5"],
    ),
    "tau out of range": (
        _set(["family", "tau"], [50.0]),
        ["family.tau", "less than or equal to 10"],
    ),
    "tau count mismatch": (
        _set(["family", "tau"], [0.1, 0.2]),
        ["2 values for 1 TPP bands"],
    ),
    "reference size not in family": (
        _set(["family", "reference", "sizes"], ["d488"]),
        ["reference.sizes", "'d488' is not a size", "did you mean 'd48'"],
    ),
    "sweep unknown hyperparameter": (
        _set(["family", "sweeps", 0, "grid"], {"weight_decy": [0.1]}),
        ["unknown hyperparameter 'weight_decy'", "did you mean 'weight_decay'"],
    ),
    "sweep size not in family": (
        _set(["family", "sweeps", 0, "size"], "d512"),
        ["sweeps[tau].size", "'d512' is not a size"],
    ),
    "unknown activation": (
        _set(["family", "arch", "activation"], "relu2"),
        ["family.arch.activation", "'gelu', 'squared_relu' or 'swiglu'"],
    ),
    "duplicate size names": (
        _set(["family", "sizes", 1, "name"], "d48"),
        ["duplicate size names ['d48']"],
    ),
    "duplicate tpp band": (
        _set(["family", "tpp"], [5.0, 5.0]),
        ["tpp: 5 listed twice", "list each value once"],
    ),
    "duplicate seeds": (
        _set(["family", "seeds"], [0, 1, 0]),
        ["seeds: 0 listed twice"],
    ),
    "duplicate reference seeds": (
        _set(["family", "reference", "seeds"], [2, 2]),
        ["reference.seeds: 2 listed twice"],
    ),
    "duplicate sweep values": (
        _set(["family", "sweeps", 0, "grid"], {"tau": [0.1, 0.2, 0.1]}),
        ["sweeps[tau].grid.tau: 0.1 listed twice"],
    ),
    "duplicate sweep fractions": (
        _set(["family", "sweeps", 0, "fractions"], [0.1, 0.1]),
        ["sweeps[tau].fractions: 0.1 listed twice"],
    ),
    "data vocabulary is not the model's": (
        _set(["family", "data", "vocab_size"], 1024),
        ["data.vocab_size: 1024 differs from arch.vocab_size 512", "set both to one value"],
    ),
    "batch table without batches": (
        _set(["family", "batch", "rule"], "table"),
        ["batch_seqs: missing for", "batch.rule is 'table'"],
    ),
    "vocabulary too small": (_set(["family", "arch", "vocab_size"], 100), ["vocab_size", "257"]),
    "too few steps": (
        _set(["family", "batch", "min_seqs"], 4096),
        ["optimizer steps", "raise family.tpp or lower the batch"],
    ),
    "fault size not in family": (
        _set(
            ["family", "faults"],
            {"size": "d129", "injections": [{"name": "a", "kind": "nan_loss"}]},
        ),
        ["faults.size", "'d129' is not a size", "did you mean"],
    ),
    "fault in a reference size": (
        _set(
            ["family", "faults"], {"size": "d48", "injections": [{"name": "a", "kind": "nan_loss"}]}
        ),
        ["faults.size", "'d48' builds the reference"],
    ),
    "unknown fault kind": (
        _set(["family", "faults"], {"injections": [{"name": "a", "kind": "bitflip"}]}),
        ["faults.injections[0](a).kind", "loss_kernel", "bitflip"],
    ),
    "holds on a fault other than wrong_tau": (
        _set(
            ["family", "faults"],
            {"injections": [{"name": "a", "kind": "nan_loss", "holds": "weight_decay"}]},
        ),
        ["holds applies to kind wrong_tau only", "remove it"],
    ),
    "contrast size not in family": (
        _set(["family", "contrast"], {"sizes": ["d129"]}),
        ["contrast.sizes: 'd129' is not a size", "did you mean"],
    ),
    "contrast of the smallest size": (
        _set(["family", "contrast"], {"sizes": ["d48"]}),
        ["contrast.sizes: 'd48' is the smallest size", "list larger sizes only"],
    ),
    "contrast of a family that fixes lambda": (
        _set(["family", "weight_decay"], 1.5),
        ["contrast: this family already holds the weight decay fixed", "contrast: null"],
    ),
    "sweep at its own reference size": (
        _set(["family", "sweeps", 0, "size"], "d48"),
        ["sweeps[tau].size: 'd48' is also the size of the sweep's reference runs", "larger size"],
    ),
    "contrast band not in family": (
        _set(["family", "contrast"], {"tpp": 7}),
        ["contrast.tpp: 7.0 is not one of the bands [5.0]"],
    ),
    "slurm cluster without partition": (
        _set(["cluster", "executor"], "slurm"),
        ["cluster", "partition"],
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_spec_names_field_and_fix(tiny_raw, case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    edit, words = MALFORMED[case]
    raw = copy.deepcopy(tiny_raw)
    edit(raw)
    message = _error(raw)
    for word in words:
        assert word in message, f"{case}: {word!r} not in message:\n{message}"
    assert not (tmp_path / "results").exists(), "a bad spec must write nothing"


def test_no_layout_fits_names_size_and_fix():
    raw = compose_config(
        ["family=celerity", "cluster=slurm_h100", "cluster.gpu_mem_gb=1", "cluster.max_nodes=1"]
    )
    message = _error(raw)
    assert "slurm_h100" in message and "memory" in message.lower()


def test_a_family_named_unlike_its_file_is_refused(tmp_path):
    """The name is the results folder: two files with one name would overwrite each other."""
    config = tmp_path / "config"
    (config / "family").mkdir(parents=True)
    (config / "cluster").mkdir()
    repo = Path(__file__).parents[1] / "config"
    (config / "config.yaml").write_text((repo / "config.yaml").read_text())
    (config / "cluster/local.yaml").write_text((repo / "cluster/local.yaml").read_text())
    (config / "family/tiny.yaml").write_text((repo / "family/tiny.yaml").read_text())
    (config / "family/mine.yaml").write_text((repo / "family/tiny.yaml").read_text())  # tiny
    assert load_config(["family=tiny"], config).family.name == "tiny"
    with pytest.raises(ConfigError) as info:
        load_config(["family=mine"], config)
    message = str(info.value)
    assert "family.name: 'tiny' differs from its file name 'mine'" in message
    assert "set name: mine" in message
    with pytest.raises(ConfigError, match="differs from its file name"):
        load_config(["family=tiny", "family.name=other"], config)


def test_a_family_in_a_sub_folder_is_named_by_its_file_stem():
    """config/family/experiments/tiny_tpp5.yaml is picked as experiments/tiny_tpp5; its name,
    and so its results folder, stays tiny_tpp5."""
    assert "experiments/tiny_tpp5" in config_options(Path(__file__).parents[1] / "config", "family")
    assert load_config(["family=experiments/tiny_tpp5"]).family.name == "tiny_tpp5"
    with pytest.raises(
        ConfigError, match=r"'tiny_tpp5' \(did you mean 'experiments/tiny_tpp5'\?\)"
    ):
        load_config(["family=tiny_tpp5"])
    with pytest.raises(ConfigError, match=r"differs from its file name 'tiny_tpp5'"):
        load_config(["family=experiments/tiny_tpp5", "family.name=other"])


def test_the_config_folder_is_the_working_directorys(tmp_path, monkeypatch):
    """Not the one beside the installed package: a second checkout plans from its own."""
    monkeypatch.delenv("COLLAPSE_CONFIG_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        load_config(["family=tiny"])
    assert f"no config.yaml in {tmp_path / 'config'}" in str(info.value)
    assert "--config-dir" in str(info.value) and "COLLAPSE_CONFIG_DIR" in str(info.value)
    repo = Path(__file__).parents[1] / "config"
    monkeypatch.setenv("COLLAPSE_CONFIG_DIR", str(repo))
    assert load_config(["family=tiny"]).family.name == "tiny"
    monkeypatch.delenv("COLLAPSE_CONFIG_DIR")
    monkeypatch.chdir(repo.parent)
    assert load_config(["family=tiny"]).family.name == "tiny"


def test_sizes_a_cpu_cluster_cannot_hold_or_would_train_for_days_are_warned_about():
    """With the numbers: 16 bytes a parameter of fp32 weights, gradients and Adam's m and v
    (activations add more), and 6ND FLOPs at the cluster's assumed throughput."""
    tiny = plan_family(load_config(["family=tiny", "cluster.mem_gb=0.001"]))
    [memory] = [w for w in tiny.warnings() if "mem_gb" in w]
    for size, params in tiny.table.groupby("size").params.max().items():
        assert f"{size} (" in memory
        assert params * 16 / 2**30 > 0.001  # the state alone is over the limit
    assert "mem_gb 0.001" in memory and "raise cluster.mem_gb" in memory
    assert plan_family(load_config(["family=tiny"])).warnings() == []

    ladder = plan_family(load_config(["family=ladder", "cluster=local"]))
    [slow] = [w for w in ladder.warnings() if "more than 24 h" in w]
    one_b = ladder.table[ladder.table["size"] == "1B"].iloc[0]
    years = 6.0 * float(one_b.params) * float(one_b.tokens) / (1e11 * 0.25) / 3600 / (24 * 365)
    assert years > 100 and "1B (" in slow and "years" in slow
    assert plan_family(load_config(["family=ladder", "cluster=slurm_h100"])).warnings() == [
        w for w in ladder.warnings() if "corpus" in w or "data.tokenizer" in w
    ]


def test_a_corpus_the_plan_cannot_count_is_said_not_silently_nan():
    """Without its files (or packages) the plan cannot know the epochs: it says so and why,
    instead of dropping the repeated-data warning."""
    plan = plan_family(
        load_config(["family=tiny", "family.data.sources=[{kind: files, glob: /absent/*.txt}]"])
    )
    [warning] = plan.warnings()
    assert "could not be counted" in warning and "no file matches '/absent/*.txt'" in warning
    assert plan.table.epochs.isna().all()
