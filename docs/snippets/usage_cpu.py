from poise_trl import POISEConfig, POISETrainer
from poise_trl.demo.model import default_cache_dir, prepare_demo_model
from poise_trl.rlvr.data import load_math_dataset
from poise_trl.rlvr.rewards import math_answer_reward

model = str(prepare_demo_model(default_cache_dir()))  # the tiny model `make demo` cached; built if missing
train_dataset = load_math_dataset("tests/fixtures/dapo_math_17k_en.jsonl")  # a local file, DAPO-Math-17k's schema
args = POISEConfig(
    output_dir="poise-cpu", use_cpu=True, bf16=False, per_device_train_batch_size=4, max_steps=2,
    max_completion_length=16, report_to="none",
)
trainer = POISETrainer(model=model, reward_funcs=math_answer_reward, args=args, train_dataset=train_dataset)
trainer.train()
