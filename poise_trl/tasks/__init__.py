"""The tasks the tools train and score on: prompts, answers and verifiable rewards.

`toy` (sort, hops: offline, for the tiny model), `arith` (chat arithmetic for real instruct models), `math_data` (the
paper's math datasets with the DAPO template) and `math_reward` (its math-verify reward). Used by `demo`, `bench`
and `rlvr`; imports no tool. `toy`, `arith` and `math_data` import `datasets` only where they build one, so the
command line reads their names and defaults cheaply.
"""
