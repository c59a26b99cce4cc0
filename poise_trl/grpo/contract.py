"""The TRL contract: every behaviour of TRL's `GRPOTrainer` (and of transformers' `Trainer` under it) that
`POISETrainer` relies on, listed once. Pure data; imports neither TRL nor torch.

`POISETrainer` subclasses `GRPOTrainer` and overrides methods TRL keeps private, so it relies on more than TRL's
public API: when TRL runs a pass, in which order its loss reads its inputs, how it buffers a generation batch. Each
behaviour here names what holds in TRL's terms, what POISE does with it, the private names of TRL it reads or writes
for it and the overrides that rely on it. `tests/contract/` holds one test per behaviour against the installed TRL,
which fails naming the behaviour when a TRL release changes it; another test checks, over every module of the
package, that every private name of TRL's trainer POISE reads or writes (an attribute of any object, or a literal
name given to `getattr`), every `RepeatSampler` attribute its subclass or a sampler TRL built reads, and every
override of a TRL method or class attribute (by `def` or assignment) is named here. Where a behaviour can be checked
cheaply at run time the trainer checks it and raises `ContractError`, naming it. docs/trl-contract.md lists the TRL
seams that would retire them.
"""

from dataclasses import dataclass

TESTED_TRL = ("1.16.0", "1.17.0")  # [low, high): the TRL releases this contract was tested against


@dataclass(frozen=True)
class Behaviour:
    """What holds in TRL (`holds`), what POISE does with it (`because`), the names of TRL's it reads or writes for it
    (`names`: attributes of an `owner`, "GRPOTrainer", whose private ones are named, or "RepeatSampler", whose every
    one is) and `POISETrainer`'s overrides of TRL methods and class attributes that rely on it."""

    holds: str
    because: str
    names: tuple[str, ...] = ()
    overrides: tuple[str, ...] = ()
    owner: str = "GRPOTrainer"


CONTRACT: dict[str, Behaviour] = {
    "old_logps_pass": Behaviour(
        holds="While scoring a batch, `_generate_and_score_completions` runs one no-grad teacher-forced pass of the "
        "policy, `_get_per_token_logps_and_entropies(self.model, ...)`, exactly when `gradient_accumulation_steps % "
        "(steps_per_generation * num_iterations) != 0` or vLLM's importance-sampling correction is on (the condition "
        "is inline in TRL; `POISETrainer._trl_runs_old_logps_pass` copies it), and no other pass of `self.model` "
        "with grad disabled during scoring.",
        because="POISE captures its features inside that pass (the 'trl_pass' route) and decides its route from the "
        "condition before the first batch.",
        overrides=("_get_per_token_logps_and_entropies",),
    ),
    "scalar_reward": Behaviour(
        holds="With multi_objective_aggregation='sum_then_normalize', the reward TRL's advantages start from is "
        "`nansum(rewards_per_func * reward_weights, dim=1)`, NaN where every function returned None (inline in TRL; "
        "`POISETrainer._scalar_rewards` copies it).",
        because="The estimator's targets and advantages start from the same reward as GRPO's.",
    ),
    "gathered_rewards": Behaviour(
        holds="`_calculate_rewards` is called once per generation batch, inside `_generate_and_score_completions` "
        "and after `_generate`, and returns every process's rewards gathered rank-major, (N, reward functions).",
        because="POISE keeps them for the estimator, which pairs rows on the gathered batch.",
        overrides=("_calculate_rewards",),
    ),
    "batch_layout": Behaviour(
        holds="In the gathered batch a prompt's rollouts are consecutive (`RepeatSampler`) and process k holds rows "
        "k*B..(k+1)*B-1; the dict `_generate_and_score_completions` returns holds this process's B rows in that "
        "order, with 'advantages' of shape (B,) and the batch's loss-token count 'num_items_in_batch' (0-d); "
        "`_logs['advantages']` ends with that batch's gathered advantages.",
        because="POISE replaces the advantages after TRL scored the batch, from baselines paired on gathered rows, "
        "rescales the token count under importance weights, and logs its own advantages in TRL's column.",
        names=("_logs", "_metrics"),
        overrides=("_generate_and_score_completions",),
    ),
    "train_buffer": Behaviour(
        holds="In training, `_prepare_inputs` generates when `_step % (steps_per_generation * num_iterations) == 0` "
        "or `_buffered_inputs` is None, shuffles the batch's rows with one `torch.randperm` (`shuffle_sequence_dict`: "
        "a list of B items added to the batch, as POISE's row indices are, travels with its rows, as tensors of "
        "length B do; a 0-d tensor stays whole), splits it into `steps_per_generation` dicts kept in the list "
        "`_buffered_inputs`, each with its slice of the list, and returns one of those dicts (the same object each "
        "iteration); `training_step` adds 1 to `_step` after the backward; `__init__` alone sets both otherwise.",
        because="POISE regroups a freshly split batch into whole-group micro-batches (in place, keeping TRL's draw), "
        "saves and restores a checkpoint's untrained slices, and drops the buffer when a `train()` call ends, so "
        "that an interrupted call leaves nothing stale.",
        names=("_buffered_inputs", "_step"),
        overrides=("_prepare_inputs", "train", "_save_checkpoint", "_load_optimizer_and_scheduler"),
    ),
    "loss_forward": Behaviour(
        holds="`_compute_loss(model, inputs)` runs the policy's forward through one call of "
        "`_get_per_token_logps_and_entropies(model, ...)`, with grad enabled in training, before it reads "
        "`inputs['advantages']`, which may be (B,) or (B, T); `training_step` calls it once per micro-batch, then "
        "the backward.",
        because="On the loss route POISE captures that forward, writes the micro-batch's advantages between the "
        "forward and their use, and observes the batch after its last micro-batch's backward.",
        overrides=("_compute_loss", "training_step"),
    ),
    "eval_batches": Behaviour(
        holds="In evaluation `_prepare_inputs` returns the output of `_generate_and_score_completions` as it is, and "
        "the loss of each evaluation batch is computed once, without grad.",
        because="An evaluation batch is one micro-batch: POISE observes it when its loss has run.",
        overrides=("evaluation_loop",),
    ),
    "logps_call": Behaviour(
        holds="`_get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, batch_size=, "
        "compute_entropy=, ...)` returns (log-probs, entropies, aux loss), entropies when `compute_entropy`; its "
        "other keyword parameters are the model inputs besides the tokens (pixel values, ...); its forward runs the "
        "decoder layers of the unwrapped `self.model`.",
        because="POISE hooks a decoder layer around that call, runs it for its own pass with the same inputs, and "
        "uses it for the prompt prefill of prompt selection.",
    ),
    "generate_tool_mask": Behaviour(
        holds="`_generate(prompts)` returns a tuple whose third item is the per-row tool/environment mask (1 where "
        "the policy wrote the token) or None, before `_generate_and_score_completions` runs any log-prob pass.",
        because="POISE's features use only the tokens the policy generated.",
        overrides=("_generate",),
    ),
    "prompt_tokens": Behaviour(
        holds="`_tokenize_prompts(prompts)` returns the prompt token ids as TRL generates from them, `_tokenizer` is "
        "the text tokenizer and `_is_vlm` says whether the model takes images.",
        because="Prompt selection prefills the candidates' prompts to predict their values before generating.",
        names=("_tokenize_prompts", "_tokenizer", "_is_vlm"),
    ),
    "train_sampler": Behaviour(
        holds="`_get_train_sampler` returns TRL's `RepeatSampler` ('repeat_sampler'), and `_get_dataloader(dataset, "
        "description, batch_size, sampler_fn, is_training)` builds the training loader from it.",
        because="Prompt selection draws more candidates per batch; a resumed run replays the uninterrupted run's "
        "prompts.",
        names=("_get_dataloader",),
        overrides=("_get_train_sampler", "get_train_dataloader"),
    ),
    "repeat_sampler": Behaviour(
        holds="`RepeatSampler` keeps its whole state in its instance dict, `batch_size` (the distinct prompts a "
        "generation batch draws, read at each pass), `shuffle`, `seed`, `num_samples` and `generator` among it; with "
        "`shuffle`, each pass draws one `torch.randperm(num_samples, generator=generator)`, from a generator seeded "
        "once with `seed`, and yields its indices in that order, in whole chunks of `batch_size`.",
        because="Prompt selection sets `batch_size` to its candidates; `resume.ResumableSampler` copies TRL's sampler "
        "and rewinds its generator to the epoch a resumed run is in.",
        names=("batch_size", "generator", "num_samples", "seed", "shuffle"),
        owner="RepeatSampler",
    ),
    "checkpoint_hooks": Behaviour(
        holds="transformers calls `_save_checkpoint(model, trial)` between optimizer steps, writing "
        "`trainer_state.json` last, under `_get_output_dir(trial)`; `_load_optimizer_and_scheduler(checkpoint)` "
        "when a run resumes.",
        because="A checkpoint inside a generation batch keeps the batch's untrained slices beside it; a resumed run "
        "restores them and the estimator.",
        names=("_get_output_dir",),
        overrides=("_save_checkpoint", "_load_optimizer_and_scheduler"),
    ),
    "save_model": Behaviour(
        holds="`save_model(output_dir=None, _internal_call=False)` writes the model into `output_dir` "
        "(`args.output_dir` when None); `_save_checkpoint` calls it with the checkpoint's folder before it writes "
        "`trainer_state.json`, and `push_to_hub` calls it, without a folder, before it uploads `args.output_dir`.",
        because="The estimator's one file is written beside the weights wherever transformers saves them: a saved or "
        "pushed model carries its probe, and every checkpoint its estimator before its trainer state.",
        overrides=("save_model",),
    ),
    "dataset_columns": Behaviour(
        holds="Without `environment_factory`, `_generate_and_score_completions` reads every row's 'prompt' (a "
        "KeyError without one); `_calculate_rewards` calls each reward function that is not a model with the "
        "keywords `validation.REWARD_KEYWORDS` (and `environments` with environments) and one per column of the batch "
        "but `validation.UNPASSED_COLUMNS`.",
        because="`POISETrainer` refuses at construction a dataset without 'prompt', or without a column a reward "
        "function's signature requires, naming the dataset's columns, instead of failing inside TRL at the first "
        "step.",
    ),
    "model_card": Behaviour(
        holds="`create_model_card` writes the output folder's README.md from the class attributes `_tag_names`, "
        "`_name` and `_paper`, with a '### Framework versions' section.",
        because="POISE's card is TRL's, with a section on how the baseline was configured and how it predicted.",
        overrides=("create_model_card", "_tag_names", "_name", "_paper"),
    ),
}


class ContractError(RuntimeError):
    """A behaviour of TRL that POISE relies on did not hold at run time."""

    def __init__(self, behaviour: str, detail: str, remedy: str = ""):
        entry = CONTRACT[behaviour]
        super().__init__(
            f"TRL contract {behaviour!r} does not hold: {detail} POISE relies on it: {entry.holds} "
            f"(tested with trl>={TESTED_TRL[0]},<{TESTED_TRL[1]}). {remedy}".rstrip()
        )
