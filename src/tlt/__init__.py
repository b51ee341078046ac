"""tlt-rl: RL training of reasoning LLMs with lossless speculative rollouts that tame the long tail."""

__version__ = "0.1.0"
