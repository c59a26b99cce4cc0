"""card.py: the model card says how POISE was configured and how well its probe predicted."""

from poise_trl import POISETrainer

from .conftest import digit_dataset, digit_reward, poise_args


def test_the_model_card_says_how_poise_was_configured(tiny_model_path, tmp_path):
    args = poise_args(tmp_path, max_steps=3, probe_bootstrap="shrunk", prompt_selection="value")
    trainer = POISETrainer(str(tiny_model_path), digit_reward, args=args, train_dataset=digit_dataset())
    trainer.train()
    trainer.create_model_card(model_name="tiny-poise")
    card = (tmp_path / "out" / "README.md").read_text()
    last = trainer.state.log_history[-2]  # the last training step's log (the final entry is the run summary)
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
        f"variance reduction {last['poise/variance_reduction']:.4f}, Pearson r {last['poise/pearson_r']:.4f}, "
        f"MAE {last['poise/mae']:.4f}",
        "2605.07579",
    ):
        assert text in card, text
    assert card.index("## POISE") < card.index("### Framework versions")  # inside TRL's card, not appended after
