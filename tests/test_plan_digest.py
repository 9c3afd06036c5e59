"""The planner's output, pinned: for every family in config/family (and config/family/experiments)
on every cluster in config/cluster, with and without the standard fault experiment, a sha256 of
every RunSpec it plans, of the plan table and of its warnings (tests/data/plan_digest.json).

A change to the planner that changes no number keeps every digest. A deliberate change of a spec
or of the table is pinned again, and the diff of the JSON shows which runs it touched:

    python tests/test_plan_digest.py --pin

The corpus is given (CORPUS_TOKENS), so nothing is read from disk but the configs: seconds.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from collapse.config import ConfigError, load_config
from collapse.plan import Plan, plan_family, plan_report_markdown

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "config"
PINNED = Path(__file__).with_name("data") / "plan_digest.json"
CORPUS_TOKENS = 10**9  # a corpus size of its own, so that the epochs column is pinned too
FAULTS = ("", "standard")


def families() -> dict[str, str]:
    """Family name -> its Hydra choice (``tiny``, ``experiments/tpp_probe``)."""
    found = {}
    for folder in (CONFIG / "family", CONFIG / "family" / "experiments"):
        for path in sorted(folder.glob("*.yaml")):
            found[path.stem] = str(path.relative_to(CONFIG / "family").with_suffix(""))
    return found


def clusters() -> list[str]:
    return sorted(p.stem for p in (CONFIG / "cluster").glob("*.yaml"))


def case_key(family: str, cluster: str, faults: str) -> str:
    return f"{family}/{cluster}" + (f"/faults={faults}" if faults else "")


def cases() -> list[tuple[str, str, str]]:
    return [(f, c, x) for f in families() for c in clusters() for x in FAULTS]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _canonical(value) -> str:
    return json.dumps(value, sort_keys=True, default=lambda o: o.item())


def plan_digest(plan: Plan) -> dict:
    table = plan.table
    return {
        "runs": {spec.run: _sha(_canonical(spec.model_dump(mode="json"))) for spec in plan.runs},
        "run_order": _sha(_canonical([spec.run for spec in plan.runs])),
        "table": _sha(
            _canonical(
                {
                    "columns": list(table.columns),
                    "dtypes": [str(t) for t in table.dtypes],
                    "rows": table.to_dict(orient="records"),
                }
            )
        ),
        "warnings": _sha(_canonical(plan.warnings())),
        "report": _sha(report_without_description(plan)),
    }


def report_without_description(plan: Plan) -> str:
    """The plan report less the family's description, which is prose, not a planned figure."""
    report, description = plan_report_markdown(plan), plan.config.family.description
    return report.replace(f"\n\n{description}\n\n", "\n\n\n\n", 1) if description else report


def digest(family: str, cluster: str, faults: str) -> dict:
    """The digests of one case, or of the error that refuses it."""
    overrides = [f"family={families()[family]}", f"cluster={cluster}"]
    if faults:
        overrides.append(f"faults={faults}")
    try:
        plan = plan_family(load_config(overrides, CONFIG), corpus_tokens=CORPUS_TOKENS)
    except ConfigError as err:
        return {"error": _sha(str(err).replace(str(ROOT), "<repo>"))}
    return plan_digest(plan)


def differences(pinned: dict, now: dict) -> list[str]:
    """What changed between two digests of one case, by run."""
    if "error" in pinned or "error" in now:
        return [f"error {pinned.get('error', 'none')[:12]} -> {now.get('error', 'none')[:12]}"]
    out = []
    before, after = pinned["runs"], now["runs"]
    out += [f"run {r} changed" for r in sorted(set(before) & set(after)) if before[r] != after[r]]
    out += [f"run {r} no longer planned" for r in sorted(set(before) - set(after))]
    out += [f"run {r} newly planned" for r in sorted(set(after) - set(before))]
    parts = ("run_order", "table", "warnings", "report")
    out += [f"{part} changed" for part in parts if pinned[part] != now[part]]
    return out


@pytest.fixture(scope="module")
def pinned() -> dict:
    return json.loads(PINNED.read_text())


def test_every_family_and_cluster_is_pinned(pinned):
    keys = {case_key(*case) for case in cases()}
    assert sorted(keys - set(pinned)) == [], "not pinned: python tests/test_plan_digest.py --pin"
    assert sorted(set(pinned) - keys) == [], "pinned, but no config any more"


@pytest.mark.parametrize("family", sorted(families()))
def test_the_plans_of_a_family_are_as_pinned(family, pinned):
    changed = []
    for case in ((family, c, x) for c in clusters() for x in FAULTS):
        key = case_key(*case)
        if key in pinned and (diff := differences(pinned[key], digest(*case))):
            changed.append(f"{key}: " + "; ".join(diff))
    assert not changed, "the planner's output changed:\n  " + "\n  ".join(changed)


if __name__ == "__main__":
    if sys.argv[1:] != ["--pin"]:
        sys.exit("usage: python tests/test_plan_digest.py --pin")
    PINNED.parent.mkdir(exist_ok=True)
    PINNED.write_text(
        json.dumps({case_key(*c): digest(*c) for c in cases()}, indent=1, sort_keys=True) + "\n"
    )
    print(f"pinned {len(cases())} cases in {PINNED}")
