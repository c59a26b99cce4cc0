"""POISE's features φ(x, y), read from one teacher-forced pass of the policy: the spans, hooks, pooling and layout
(features.py), the rollout scalars (columns.py) and the reference's text spans (text_spans.py), the per-prefix
features (prefix.py) and the capture of a whole pass (capture.py). Pure torch: imports neither TRL nor transformers,
and of the library only the value heads (the per-prefix head is folded into the hook)."""
