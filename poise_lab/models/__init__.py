"""The models the lab runs: the tiny offline Qwen3 (`poise_trl.tiny`) warm-started on a toy task and its held-out
avg@k (`toy`), and real instruct models converted from PyPI GGUF packages (`real`, registered for `poise-trl train` as
entry points `poise_trl.named_models`). Used by `demo` and `bench`; imports `tasks` and no tool.
"""
