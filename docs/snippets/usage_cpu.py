from poise_trl import POISEConfig, POISETrainer
from poise_lab.models.toy import default_cache_dir, prepare_demo_model
from poise_trl.tasks.math_data import load_math_dataset
from poise_trl.tasks.math_reward import math_answer_reward

# Offline on a CPU, from the repository root: a local file in DAPO-Math-17k's schema and the demo's tiny model
# (cached by `make demo`, else built here first). It checks the set-up end to end; a 1M-parameter
# sorting model scores 0 on math, so nothing is learned.
dataset = load_math_dataset("tests/fixtures/dapo_math_17k_en.jsonl")
model = str(prepare_demo_model(default_cache_dir()))
args = POISEConfig(
    output_dir="poise-cpu-smoke",
    per_device_train_batch_size=4,  # 2 prompts x 2 rollouts per step
    max_steps=4,
    max_completion_length=32,
    use_cpu=True,
    bf16=False,
)
trainer = POISETrainer(model=model, reward_funcs=math_answer_reward, args=args, train_dataset=dataset)
trainer.train()
