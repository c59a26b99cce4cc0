"""The tasks the tools train and score on: prompts, answers and verifiable rewards.

`toy` (sort, hops: offline, for the tiny model), `arith` (chat arithmetic for real instruct models), `math_data` and
`math_reward` (the paper's math datasets with the DAPO template, and its math-verify reward). Used by `demo`, `bench`
and `rlvr`; imports no tool. The modules stay light at import (datasets, math-verify load where they are used or in
their own module), so the command line can read their registries and defaults.
"""
