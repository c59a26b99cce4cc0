"""POISE inside TRL's GRPO trainer: `POISEConfig` (a `GRPOConfig`) with its checks and migration, `POISETrainer` (a
`GRPOTrainer`) with its capture routes, prompt selection, generation-batch record and resumes, the model card, and
the contract of every TRL behaviour they rely on. The only code that knows TRL's internals; the packages below it
(heads, features, estimator) import neither TRL nor transformers."""
