from poise_trl import POISEConfig, POISETrainer
from poise_trl.tasks.math_data import load_math_dataset
from poise_trl.tasks.math_reward import math_answer_reward

# open-r1/DAPO-Math-17k-Processed ("en"): DAPO's prompt template applied, the final answer in `answer`
dataset = load_math_dataset("DAPO-Math-17k-en")
model = "Qwen/Qwen3-4B"
# num_generations defaults to 2; Qwen3 thinks at length, and TRL's default of 512 tokens would cut most reasoning
# before `</think>`, which the probe reads: give it the paper's 8192
args = POISEConfig(output_dir="poise-qwen3-4b", per_device_train_batch_size=8, max_completion_length=8192)
trainer = POISETrainer(model=model, reward_funcs=math_answer_reward, args=args, train_dataset=dataset)
trainer.train()
