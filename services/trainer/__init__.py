"""The trainer service: GRPO / PPO / SFT on Hugging Face models (`fulmen trainer`)."""
