"""Run roles: one type whose members are the strings of spec files and runs.csv, and which owns
each role's name, early stop and reference and monitor flags."""

import io

import pandas as pd

from collapse.config import load_config
from collapse.plan import plan_family
from collapse.roles import SWEEP_ROLES, Role
from collapse.runspec import RunSpec


def test_a_role_is_its_string_in_a_spec_file_and_in_runs_csv():
    plan = plan_family(load_config(["family=tiny", "faults=standard"]), corpus_tokens=10**9)
    assert {s.role for s in plan.runs} == set(Role)
    for spec in plan.runs:
        assert f'"role": "{spec.role.value}"' in spec.to_json()
        assert RunSpec.model_validate_json(spec.to_json()).role == spec.role
    read_back = pd.read_csv(io.StringIO(plan.table.to_csv(index=False)))
    for role in Role:
        assert list(read_back.run[read_back.role == role]) == plan.run_names(role)
    assert set(read_back.run[read_back.role.isin(SWEEP_ROLES)]) == {
        s.run for s in plan.runs if s.sweep
    }


def test_each_role_names_its_runs_and_sets_its_flags():
    plan = plan_family(load_config(["family=tiny", "faults=standard"]), corpus_tokens=10**9)
    table = plan.table.set_index("run")
    prefixes = {
        Role.FAMILY: "d",
        Role.SWEEP: "sweep-",
        Role.SWEEP_REFERENCE: "sweepref-",
        Role.FAULT: "fault-",
        Role.CONTRAST: "contrast-",
    }
    for spec in plan.runs:
        assert spec.run.startswith(prefixes[spec.role]), spec.run
        row = table.loc[spec.run]
        assert not row.is_reference or spec.role == Role.FAMILY
        assert not row.monitored or spec.role in (Role.FAMILY, Role.FAULT)
        assert spec.optim.stop_fraction == 1.0 or spec.role == Role.SWEEP
        assert (row.same_as == "") or spec.role.in_sweep
    reference = set(table.index[table.is_reference])
    assert reference and {plan.spec(r).size for r in reference} <= set(
        plan.config.family.reference.sizes
    )


def test_a_sweep_variant_stopped_early_shares_the_family_run_it_is_the_start_of():
    """tiny's tau sweep at d128 stops its variants at 30 %; the variant at the family's own tau
    and seed trains the first 30 % of d128-tpp10-s0 step for step (same schedule), so it is that
    run, trained once, and its true final loss is known. Variants at other taus are their own."""
    for validate in ("false", "true"):
        cfg = load_config(["family=tiny", f"family.sweeps.0.validate_full={validate}"])
        table = plan_family(cfg, corpus_tokens=10**9).table.set_index("run")
        assert table.at["sweep-tau-d128-tau0.2-s0", "same_as"] == "d128-tpp10-s0"
        assert table.at["sweep-tau-d128-tau0.1-s0", "same_as"] == ""
        assert table.at["sweep-tau-d128-tau0.4-s0", "same_as"] == ""
        assert table.at["sweepref-tau-d96-tau0.2-s0", "same_as"] == "d96-tpp10-s0"


def test_a_sweep_reference_with_several_seeds_plans_one_run_per_tau_and_seed():
    """reference_seeds [0, 1, 2]: three small runs per tau of the grid, named by their seed; at
    the family's own tau they are the family's reference seeds, trained once."""
    cfg = load_config(["family=tiny", "+family.sweeps.0.reference_seeds=[0,1,2]"])
    table = plan_family(cfg, corpus_tokens=10**9).table.set_index("run")
    refs = table[table.role == Role.SWEEP_REFERENCE]
    assert sorted(refs.index) == sorted(
        f"sweepref-tau-d96-tau{tau}-s{seed}" for tau in (0.1, 0.2, 0.4) for seed in (0, 1, 2)
    )
    assert list(refs.loc[[f"sweepref-tau-d96-tau0.2-s{s}" for s in (0, 1, 2)], "same_as"]) == [
        f"d96-tpp10-s{s}" for s in (0, 1, 2)
    ]
    assert (refs.loc[[f"sweepref-tau-d96-tau0.4-s{s}" for s in (0, 1, 2)], "same_as"] == "").all()
    assert list(refs.seed[refs.tau.round(4) == 0.1]) == [0, 1, 2]
