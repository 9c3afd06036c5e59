"""tiny_tpp5's real tau sweep on a CPU (config/family/experiments/tiny_tpp5.yaml): three
variants at d96 cut at 10-30 % of training, each predicted against the small d48 run of its own
tau, every variant also trained to the end for the truth. The sweep also waits for the family's
own runs at TPP 5 other than d96 (d48, d64, d128, d192: its size drift, collapse.sweep_drift).
The sweep alone took about 4.5 minutes on two cores (262 s measured) before it needed the family;
marked slow and left out of CI's subset (the smoke family's sweep in the e2e test is in it)."""

import pandas as pd
import pytest
from workflow_cli import run_snakemake

pytestmark = pytest.mark.slow


def test_tiny_tau_sweep_predicts_better_than_the_loss_now(tmp_path):
    run_snakemake(
        tmp_path,
        "results/tiny_tpp5/sweeps/tau/metrics.csv",
        "--config",
        "family=experiments/tiny_tpp5",
        timeout=2400,
    )

    sweep = tmp_path / "results/tiny_tpp5/sweeps/tau"
    preds = pd.read_csv(sweep / "predictions.csv")
    assert preds.run.nunique() == 3 and set(preds.fraction) == {0.1, 0.2, 0.3}
    assert set(preds.method) == {"collapse", "current", "powerlaw", "drift"}
    assert (preds.lower <= preds.predicted_final_loss).all()
    assert (preds.predicted_final_loss <= preds.upper).all()
    # each variant is predicted against the d48 run of its own tau
    tau = preds.run.str.extract(r"tau([\d.]+)-s")[0]
    assert (preds.reference_run.str.extract(r"tau([\d.]+)-s")[0] == tau).all()

    metrics = pd.read_csv(sweep / "metrics.csv").set_index(["method", "fraction"])
    at_30 = metrics.xs(0.3, level="fraction").mean_abs_error_pct
    assert at_30["collapse"] < at_30["current"]
    regret = metrics.xs(0.3, level="fraction").regret_loss
    assert regret["collapse"] <= regret["random"]  # no worse than picking blind
