from poise_trl import POISEConfig, POISETrainer
from poise_trl.rlvr.data import load_math_dataset
from poise_trl.rlvr.rewards import math_answer_reward

# DAPO-Math-17k (English) with the DAPO prompt template; `answer` is the column math_answer_reward reads.
train_dataset = load_math_dataset("DAPO-Math-17k-en")
args = POISEConfig(output_dir="qwen3-4b-poise", per_device_train_batch_size=8)  # num_generations defaults to 2
trainer = POISETrainer(model="Qwen/Qwen3-4B", reward_funcs=math_answer_reward, args=args, train_dataset=train_dataset)
trainer.train()
