"""The models the tools run: the tiny offline Qwen3 (`tiny`), its warm start on a toy task and held-out avg@k
(`toy`), real instruct models converted from PyPI GGUF packages (`real`), and avg@k sampling with HF `generate` or
vLLM (`avg_at_k`). Used by `demo`, `bench` and `rlvr`; imports `tasks` and no tool.
"""
