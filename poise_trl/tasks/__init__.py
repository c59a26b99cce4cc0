"""The RLVR kit's math tasks: `math_data` (the paper's math datasets with the DAPO template) and `math_reward` (its
math-verify reward). Used by `rlvr` and by users' scripts; imports no tool. `math_data` imports `datasets` only where
it builds one, so the command line reads its registry cheaply.
"""
