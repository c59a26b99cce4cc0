"""card.py: the model card says how POISE was configured and how well its probe predicted."""

import math
from statistics import fmean

from poise_trl import POISETrainer
from poise_trl.grpo.card import late_diagnostics

from .conftest import digit_dataset, digit_reward, poise_args


def test_the_model_card_says_how_poise_was_configured(tiny_model_path, tmp_path):
    args = poise_args(tmp_path, max_steps=8, probe_bootstrap="shrunk", prompt_selection="value")
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.train()
    trainer.create_model_card(model_name="tiny-poise")
    card = (tmp_path / "out" / "README.md").read_text()
    late = [log for log in trainer.state.log_history if log.get("step", 0) >= 7]  # steps 7 and 8 of 8
    keys = ("variance_reduction", "pearson_r", "mae")
    mean = {key: fmean(log[f"poise/{key}"] for log in late if f"poise/{key}" in log) for key in keys}
    for text in (
        "## POISE",
        "Rollouts per prompt (G): 2",
        "Probe preset: paper (probe_alpha=0.01, probe_pca_dims=[0, 0]",
        "Value head (probe_head): ridge; granularity (probe_granularity): sequence",
        "Probe layer: default (in use: 2; candidates: [2])",
        "Partner-aware probe (probe_partner_reward): False",
        "rollout scalars (probe_scalars): ['output_mean_token_entropy', 'reasoning_mean_token_entropy', "
        "'answer_mean_token_entropy']",
        "Prompt history (probe_history): off",
        "Bootstrap (probe_bootstrap): shrunk",
        "Prompt selection: value (oversample 2.0)",
        "Probe diagnostics (mean of the logs of steps 7-8, the last quarter of training): variance reduction "
        f"{mean['variance_reduction']:.4f}, Pearson r {mean['pearson_r']:.4f}, MAE {mean['mae']:.4f}",
        "2605.07579",
    ):
        assert text in card, text
    assert card.index("## POISE") < card.index("### Framework versions")  # inside TRL's card, not appended after


def test_the_diagnostics_are_the_last_quarters_not_the_last_steps():
    """A last step whose rewards all tied logs no Pearson r: the card still shows the quarter's other logs."""
    history = [{"step": step, "poise/pearson_r": 0.1 * step, "poise/mae": 0.5} for step in range(1, 24)]
    history += [{"step": 24, "poise/mae": 0.7}, {"step": 24, "train_runtime": 1.0}]
    values, first = late_diagnostics(history, 24)
    assert first == 19
    assert math.isclose(values["pearson_r"], 0.1 * fmean(range(19, 24)))
    assert math.isclose(values["mae"], fmean([0.5] * 5 + [0.7]))
    assert math.isnan(values["variance_reduction"])  # logged nowhere: the card says "not logged"
    assert late_diagnostics(history, 0)[1] == 1 and math.isnan(late_diagnostics(history[:2], 8)[0]["mae"])
