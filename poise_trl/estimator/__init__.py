"""`POISEEstimator` and everything it is made of: what POISE learns across steps, for any training loop. Pure torch:
imports neither TRL nor transformers, and of the library only the heads, the features and the light `settings` and
`presets`."""
