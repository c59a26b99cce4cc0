"""The lab's tasks: prompts, answers and verifiable rewards for the tiny and the small real models.

`toy` (sort, hops: offline, for the tiny model) and `arith` (chat arithmetic for real instruct models, registered for
`poise-trl train --dataset_name arith` as an entry point `poise_trl.datasets`). Used by `demo` and `bench`; imports
no tool. Both import `datasets` only where they build one, so the command line reads their names and defaults
cheaply.
"""
